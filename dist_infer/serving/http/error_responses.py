"""What each failure means to an HTTP client: errors in OpenAI's shape (ApiError and the shape
itself: serving/http/guard.py), never FastAPI's 422; unexpected ones as a generic 500 with an id."""

from __future__ import annotations

import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dist_infer.engine.request import RequestError
from dist_infer.engine.sampling import SamplingParamsError
from dist_infer.serving.fleet.interface import EngineDeadError, QueueFullError
from dist_infer.serving.http.chat import ChatError
from dist_infer.serving.http.guard import ApiError, error_response, internal_error
from dist_infer.serving.http.protocol import ProtocolError
from dist_infer.serving.http.streams import ClientGone


def api_error_of(exc: BaseException) -> ApiError:
    """What each known failure means to the client."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, (ProtocolError, ChatError, RequestError, SamplingParamsError)):
        return ApiError(400, str(exc), getattr(exc, "field", None))
    if isinstance(exc, QueueFullError):
        retry = max(1, math.ceil(exc.retry_after_s))
        return ApiError(503, str(exc), None, {"Retry-After": str(retry)})
    if isinstance(exc, EngineDeadError):
        return ApiError(500, f"the engine failed: {exc}")
    return internal_error(exc)


def add_error_handlers(app: FastAPI) -> None:
    """Errors in OpenAI's shape, never FastAPI's 422; unexpected ones as a generic 500 with an id."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return error_response(exc)

    async def _known_error(_: Request, exc: Exception):
        return error_response(api_error_of(exc))

    for kind in (ProtocolError, ChatError, RequestError, SamplingParamsError, QueueFullError, EngineDeadError):
        app.add_exception_handler(kind, _known_error)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        return error_response(
            ApiError(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}", loc[0] if loc else None)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail), None, dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(internal_error(exc, f"{request.method} {request.url.path}"))

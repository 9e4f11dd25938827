"""The OpenAI-compatible HTTP API in front of the engine (FastAPI on uvicorn).

Shaped as OpenAI and vLLM shape it, so existing clients and dashboards work unchanged:
`/v1/completions`, `/v1/chat/completions` (streamed as server-sent events or not), `/v1/models`,
`/health`, `/metrics`, and vLLM's `/tokenize` and `/detokenize`. Every response also carries the
token ids (vLLM's `return_token_ids` shape, always on): `prompt_token_ids`, and per choice
`token_ids` (in a stream: each chunk's new ids), so clients can check tokens exactly.

The engine is anything with the EngineClient interface (serving/cluster.py implements it):

    model_name: str; max_model_len: int; vocab_size: int
    tokenizer: Optional[TextTokenizer]   # None: token-id prompts only
    chat_template: Optional[str]
    check_request(prompt_token_ids, params) -> None   # raises RequestError(field, message)
    generate(request_id, prompt_token_ids, params) -> AsyncIterator[RequestOutput]
        # raises QueueFullError (-> 503 + Retry-After) or EngineDeadError (-> 500)
    abort(request_id) -> None             # thread-safe, idempotent
    stats() -> dict                       # num_requests_running, ..., free_blocks, total_blocks
    dead_reason: Optional[str]
    begin_shutdown() -> None

This process owns every client's stream, so a client that goes away (a closed stream, or a
closed connection while a non-streamed answer is pending) becomes engine.abort(request_id)
here, and the request's KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import signal
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from loguru import logger
from starlette.exceptions import HTTPException as StarletteHTTPException

from dist_infer.engine.request import RequestError, RequestOutput
from dist_infer.engine.sampling import SamplingParams, SamplingParamsError
from dist_infer.serving.chat import ChatError, ChatRenderer
from dist_infer.serving.errors import EngineDeadError, QueueFullError
from dist_infer.serving.http_guard import (ApiError, HttpGuard, error_body, error_response, install_guard,
                                           internal_error)
from dist_infer.serving.metrics import RequestClock, ServingMetrics
from dist_infer.serving.protocol import (COMPLETION_DEFAULT_MAX_TOKENS, AddInstanceBody, ChatCompletionRequest,
                                         CompletionRequest, DetokenizeRequest, MigrateBody, ProtocolError,
                                         TokenizeRequest, default_chat_max_tokens, json_of, openapi_body, parse_body,
                                         prompt_of, sampling_params_of)

DEFAULT_SHUTDOWN_GRACE_S = 30.0  # running requests get this long to finish after SIGTERM, then are aborted
ABORT_SLACK_S = 5.0  # after aborting, this long for the aborted streams to end before uvicorn cancels them
DISCONNECT_POLL_S = 0.25  # how often a pending non-streamed request checks that its client is still there
DRAINING_RETRY_AFTER_S = 5.0
MIN_LOGPROB = -9999.0  # what -inf becomes (JSON has no infinities), as vLLM does


# -- errors (ApiError and the OpenAI error shape: serving/http_guard.py) --------------------------------

class ClientGone(Exception):
    """The client closed its connection while its answer was being made."""


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


def sse(data: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# -- one request's stream of deltas -----------------------------------------------------------------

class EngineStream:
    """One request's deltas from the engine, with what every endpoint needs around them: the
    metrics clock fed on each delta, and an abort if it ends before the engine finished it."""

    def __init__(self, state: "ServingState", request_id: str, prompt_ids: list[int], params: SamplingParams,
                 clock: RequestClock):
        self.state = state
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.clock = clock
        self.finished = False
        self.closed = False
        self._gen = state.engine.generate(request_id, prompt_ids, params)

    async def next(self) -> Optional[RequestOutput]:
        """The next delta; None after the finished one. A generator that ends without a finished
        delta reads as an abort."""
        if self.finished:
            return None
        try:
            out = await self._gen.__anext__()
        except StopAsyncIteration:
            out = RequestOutput(self.request_id, [], [], [], "", True, "abort", None, len(self.prompt_ids),
                                self.clock.num_generated)
        except Exception:
            self.finished = True  # raised by the engine (queue full, dead): nothing of it is left to abort
            self.state.active.pop(self.request_id, None)
            raise
        self.clock.on_output(out)
        if out.error:
            self.finished = True
            self.clock.on_end("error")
            raise EngineDeadError(out.error)
        if out.finished:
            self.finished = True
            self.clock.on_end(out.finish_reason)
            self.state.active.pop(self.request_id, None)
        return out

    async def collect(self) -> list[RequestOutput]:
        outputs = []
        while (out := await self.next()) is not None:
            outputs.append(out)
        return outputs

    async def close(self) -> None:
        """End it: abort in the engine if unfinished (first, synchronously, so even a cancelled
        close frees the KV blocks), then close the engine's generator."""
        if self.closed:
            return
        self.closed = True
        self.state.active.pop(self.request_id, None)
        if not self.finished:
            self.finished = True
            self.state.engine.abort(self.request_id)
            self.clock.on_end("abort")
            logger.info(f"request {self.request_id} aborted: its client went away or the server is stopping")
        try:
            await self._gen.aclose()
        except Exception as exc:  # noqa: BLE001 - the request is over either way
            logger.debug(f"closing the stream of {self.request_id}: {exc}")


async def close_shielded(stream: EngineStream) -> None:
    with anyio.CancelScope(shield=True):
        await stream.close()


async def until_disconnect(request: Request, awaitable) -> Any:
    """Await `awaitable` while checking that the client is still connected; ClientGone if not."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})


class EventStream(StreamingResponse):
    """Server-sent events whose engine request is closed however the stream ends: finished,
    the client gone (Starlette cancels the sender), or the server cancelling it at shutdown."""

    def __init__(self, events: AsyncIterator[str], stream: EngineStream, headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        self.engine_stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.engine_stream.close()


# -- response shapes ----------------------------------------------------------------------------------

def _logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


class ResponseShaper:
    """Turns deltas into one endpoint's OpenAI objects; counts what was sent for the usage."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, state: "ServingState", request_id: str, prompt_ids: list[int], num_logprobs: Optional[int]):
        self.state = state
        self.request_id = request_id
        self.created = int(time.time())
        self.prompt_ids = prompt_ids
        self.num_logprobs = num_logprobs
        self.num_generated = 0
        self.first_chunk = True

    def head(self, object_name: str) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.state.served_name}

    def usage(self) -> dict:
        n = len(self.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": self.num_generated, "total_tokens": n + self.num_generated}

    def usage_chunk(self) -> dict:
        return {**self.head(self.chunk_object_name), "choices": [], "usage": self.usage()}

    def opening_chunks(self) -> list[dict]:
        return []

    def top_dict(self, entries: list[tuple[int, float]]) -> dict[str, float]:
        """token text -> logprob; two ids with the same text keep both (the second as token_id:N)."""
        out: dict[str, float] = {}
        for token_id, lp in entries:
            key = self.state.token_text(token_id)
            out[key if key not in out else f"token_id:{token_id}"] = _logprob(lp)
        return out


class CompletionShaper(ResponseShaper):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_offset = 0

    def logprobs(self, out: RequestOutput) -> Optional[dict]:
        if self.num_logprobs is None:
            return None
        tokens = [self.state.token_text(t) for t in out.new_token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        if out.new_top_logprobs:
            tops = [self.top_dict(entry) for entry in out.new_top_logprobs]
        else:  # logprobs=0: the chosen token only
            tops = [{tok: _logprob(lp)} for tok, lp in zip(tokens, out.new_logprobs)]
        return {"tokens": tokens, "token_logprobs": [_logprob(lp) for lp in out.new_logprobs],
                "top_logprobs": tops, "text_offset": offsets}

    def chunk(self, out: RequestOutput, include_usage: bool, continuous_usage: bool) -> Optional[dict]:
        if not out.new_token_ids and not out.text_delta and not out.finished:
            return None
        self.num_generated += len(out.new_token_ids)
        choice = {"index": 0, "text": out.text_delta, "logprobs": self.logprobs(out),
                  "finish_reason": out.finish_reason if out.finished else None,
                  "stop_reason": out.stop_reason if out.finished else None,
                  "token_ids": list(out.new_token_ids),
                  "prompt_token_ids": self.prompt_ids if self.first_chunk else None}
        self.first_chunk = False
        chunk = {**self.head(self.chunk_object_name), "choices": [choice]}
        if include_usage:
            chunk["usage"] = self.usage() if continuous_usage else None
        return chunk

    def response(self, outputs: list[RequestOutput]) -> dict:
        ids = [t for o in outputs for t in o.new_token_ids]
        self.num_generated = len(ids)
        last = outputs[-1]
        logprobs = None
        if self.num_logprobs is not None:
            parts = [self.logprobs(o) for o in outputs]
            logprobs = {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs",
                                                                             "top_logprobs", "text_offset")}
        choice = {"index": 0, "text": "".join(o.text_delta for o in outputs), "logprobs": logprobs,
                  "finish_reason": last.finish_reason, "stop_reason": last.stop_reason, "prompt_logprobs": None,
                  "token_ids": ids, "prompt_token_ids": self.prompt_ids}
        return {**self.head(self.object_name), "choices": [choice], "usage": self.usage(),
                "system_fingerprint": None, "prompt_token_ids": self.prompt_ids}


class ChatShaper(ResponseShaper):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs(self, out: RequestOutput) -> Optional[dict]:
        if self.num_logprobs is None:
            return None
        content = []
        tops = out.new_top_logprobs or [[] for _ in out.new_token_ids]
        for token_id, lp, top in zip(out.new_token_ids, out.new_logprobs, tops):
            content.append({**self._entry(token_id, lp),
                            "top_logprobs": [self._entry(t, tlp) for t, tlp in top[: self.num_logprobs]]})
        return {"content": content}

    def _entry(self, token_id: int, lp: float) -> dict:
        text = self.state.token_text(token_id)
        return {"token": text, "logprob": _logprob(lp), "bytes": list(text.encode("utf-8"))}

    def opening_chunks(self) -> list[dict]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
                  "token_ids": []}
        self.first_chunk = False
        return [{**self.head(self.chunk_object_name), "choices": [choice], "prompt_token_ids": self.prompt_ids}]

    def chunk(self, out: RequestOutput, include_usage: bool, continuous_usage: bool) -> Optional[dict]:
        if not out.new_token_ids and not out.text_delta and not out.finished:
            return None
        self.num_generated += len(out.new_token_ids)
        choice = {"index": 0, "delta": {"content": out.text_delta}, "logprobs": self.logprobs(out),
                  "finish_reason": out.finish_reason if out.finished else None,
                  "stop_reason": out.stop_reason if out.finished else None,
                  "token_ids": list(out.new_token_ids)}
        chunk = {**self.head(self.chunk_object_name), "choices": [choice], "prompt_token_ids": None}
        if include_usage:
            chunk["usage"] = self.usage() if continuous_usage else None
        return chunk

    def response(self, outputs: list[RequestOutput]) -> dict:
        ids = [t for o in outputs for t in o.new_token_ids]
        self.num_generated = len(ids)
        last = outputs[-1]
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = {"content": [e for o in outputs for e in self.logprobs(o)["content"]]}
        message = {"role": "assistant", "content": "".join(o.text_delta for o in outputs), "refusal": None,
                   "tool_calls": []}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": last.finish_reason,
                  "stop_reason": last.stop_reason, "token_ids": ids}
        return {**self.head(self.object_name), "choices": [choice], "usage": self.usage(),
                "system_fingerprint": None, "prompt_token_ids": self.prompt_ids}


# -- the app ------------------------------------------------------------------------------------------

class ServingState:
    """What the endpoints share: the engine, the names the model answers to, the chat renderer,
    the metrics, the requests in flight, and whether the server is draining for shutdown."""

    def __init__(self, engine, served_model_name: Optional[str]):
        self.engine = engine
        self.served_name = served_model_name or engine.model_name
        self.model_names = {self.served_name, engine.model_name}
        self.metrics = ServingMetrics(self.served_name, engine.stats, engine.max_model_len)
        self.renderer = ChatRenderer.for_tokenizer(engine.chat_template, engine.tokenizer)
        self.active: dict[str, EngineStream] = {}
        self.draining = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(400, f"model {model!r} is not served here; this server serves {self.served_name!r}", "model")

    def check_accepting(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", None,
                           {"Retry-After": str(int(DRAINING_RETRY_AFTER_S))})

    def need_tokenizer(self, field: str, what: str) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, f"{what} needs a tokenizer and this model has none; send token ids", field)
        return self.tokenizer

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs (str(id) without a tokenizer; special tokens by name)."""
        tok = self.tokenizer
        if tok is None:
            return str(token_id)
        text = tok.decode([token_id])
        if not text:
            piece = getattr(tok, "token", None)
            text = (piece(token_id) if piece is not None else None) or ""
        return text

    def open_stream(self, prefix: str, prompt_ids: list[int], params: SamplingParams, arrival: float) -> EngineStream:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        clock = self.metrics.request(arrival, len(prompt_ids))
        stream = EngineStream(self, request_id, prompt_ids, params, clock)
        self.active[request_id] = stream
        return stream

    def fit_default_max_tokens(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """check_request, shrinking a defaulted max_tokens until it fits (the KV cache may hold fewer
        tokens than the model has positions)."""
        while True:
            try:
                self.engine.check_request(prompt_ids, params)
                return params
            except RequestError as exc:
                if exc.field != "max_tokens" or params.max_new_tokens <= 1:
                    raise
                try:
                    params = dataclasses.replace(params, max_new_tokens=params.max_new_tokens // 2)
                except SamplingParamsError:
                    raise exc from None

    def begin_drain(self) -> None:
        """Stop taking requests (503 from now on); those running may finish."""
        if not self.draining:
            self.draining = True
            logger.info(f"draining: {len(self.active)} running request(s) may finish, new ones get 503")
            try:
                self.engine.begin_shutdown()
            except Exception as exc:  # noqa: BLE001 - a dead engine cannot refuse anything anyway
                logger.debug(f"engine.begin_shutdown(): {exc}")

    def abort_all(self, why: str) -> None:
        if self.active:
            logger.warning(f"{why}: aborting {len(self.active)} running request(s)")
        for request_id in list(self.active):
            self.engine.abort(request_id)


async def read_json(request: Request) -> Any:
    return json_of(await request.body())


async def off_loop(fn: Callable, *args, **kwargs) -> Any:
    """Tokenizing or templating a long prompt, in a thread: the event loop keeps answering meanwhile."""
    return await asyncio.to_thread(fn, *args, **kwargs)


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
        return error_response(ApiError(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                                       loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(ApiError(exc.status_code, str(exc.detail), None, dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(internal_error(exc, f"{request.method} {request.url.path}"))


def build_app(engine, served_model_name: Optional[str] = None, guard: HttpGuard = HttpGuard()) -> FastAPI:
    """The FastAPI app serving `engine` (see the module docstring for the interface it needs),
    behind `guard` (keys, body limits, CORS: serving/http_guard.py)."""
    state = ServingState(engine, served_model_name)
    app = FastAPI(title="dist_infer OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.serving = state
    install_guard(app, guard)

    add_error_handlers(app)

    # -- generation ------------------------------------------------------------------------------------
    async def run(request: Request, stream: EngineStream, shaper: ResponseShaper, body) -> Response:
        headers = {"X-Request-Id": stream.request_id}
        if body.stream:
            try:
                first = await until_disconnect(request, stream.next())
            except BaseException:
                await close_shielded(stream)
                raise
            events = sse_events(stream, shaper, first, body.include_usage, body.continuous_usage)
            return EventStream(events, stream, headers)
        try:
            outputs = await until_disconnect(request, stream.collect())
        finally:
            await close_shielded(stream)
        return JSONResponse(shaper.response(outputs), headers=headers)

    async def sse_events(stream: EngineStream, shaper: ResponseShaper, first: RequestOutput,
                         include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        try:
            for chunk in shaper.opening_chunks():
                yield sse(chunk)
            out = first
            while out is not None:
                chunk = shaper.chunk(out, include_usage, continuous_usage)
                if chunk is not None:
                    yield sse(chunk)
                out = await stream.next()
            if include_usage:
                yield sse(shaper.usage_chunk())
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report it as an event
            err = api_error_of(exc)  # logs what is unexpected
            yield sse(error_body(err.status, err.message, err.param))
        yield SSE_DONE

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        arrival = time.monotonic()
        state.check_accepting()
        body: CompletionRequest = parse_body(CompletionRequest, await read_json(request))
        state.check_model(body.model)
        prompt = prompt_of(body.prompt)
        if isinstance(prompt, str):
            prompt_ids = await off_loop(state.need_tokenizer("prompt", "a text prompt").encode, prompt, add_bos=True)
        else:
            prompt_ids = prompt
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params_of(body, max_tokens, state.tokenizer is not None)
        engine.check_request(prompt_ids, params)
        stream = state.open_stream("cmpl", prompt_ids, params, arrival)
        return await run(request, stream, CompletionShaper(state, stream.request_id, prompt_ids, params.logprobs), body)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        state.check_accepting()
        body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await read_json(request))
        state.check_model(body.model)
        tokenizer = state.need_tokenizer("messages", "chat")
        text = await off_loop(state.renderer.render, body.messages, bool(body.add_generation_prompt),
                              body.chat_template_kwargs)
        prompt_ids = await off_loop(tokenizer.encode, text, add_bos=True)
        max_tokens = body.requested_max_tokens
        if max_tokens is None:
            max_tokens = default_chat_max_tokens(len(prompt_ids), engine.max_model_len)
            if max_tokens < 1:
                raise ApiError(400, f"the messages make a prompt of {len(prompt_ids)} tokens; the model has "
                                    f"{engine.max_model_len} positions", "messages")
            params = state.fit_default_max_tokens(prompt_ids, sampling_params_of(body, max_tokens, True))
        else:
            params = sampling_params_of(body, max_tokens, True)
            engine.check_request(prompt_ids, params)
        stream = state.open_stream("chatcmpl", prompt_ids, params, arrival)
        return await run(request, stream, ChatShaper(state, stream.request_id, prompt_ids, params.logprobs), body)

    # -- the rest ------------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        card = {"id": state.served_name, "object": "model", "created": int(time.time()), "owned_by": "dist_infer",
                "root": engine.model_name, "parent": None, "max_model_len": engine.max_model_len, "permission": []}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if engine.dead_reason:
            return error_response(ApiError(503, f"the engine failed: {engine.dead_reason}"))
        if state.draining:
            return error_response(ApiError(503, "the server is shutting down"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    if hasattr(engine, "describe_instances"):
        add_admin_routes(app, engine)

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request):
        body: TokenizeRequest = parse_body(TokenizeRequest, await read_json(request))
        state.check_model(body.model)
        if body.messages is not None:
            tok = state.need_tokenizer("messages", "tokenize")
            text = await off_loop(state.renderer.render, body.messages, bool(body.add_generation_prompt))
            ids = await off_loop(tok.encode, text, add_bos=True)
        elif body.prompt is not None:
            tok = state.need_tokenizer("prompt", "tokenize")
            ids = await off_loop(tok.encode, body.prompt, add_bos=bool(body.add_special_tokens))
        else:
            raise ApiError(400, "send prompt or messages", "prompt")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request):
        body: DetokenizeRequest = parse_body(DetokenizeRequest, await read_json(request))
        state.check_model(body.model)
        tok = state.need_tokenizer("tokens", "detokenize")
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise ApiError(400, f"tokens has ids {bad[:5]} outside the vocabulary of {engine.vocab_size}", "tokens")
        return {"prompt": await off_loop(tok.decode, body.tokens)}

    return app


# -- serving ------------------------------------------------------------------------------------------

def add_admin_routes(app: FastAPI, cluster) -> None:
    """Operators' (and tests') view of the instances: their load and requests, a forced
    migration, draining, stopping, restarting and adding an instance (serving/cluster.py does the work)."""
    from dist_infer.serving.cluster import AdminError

    if getattr(app.state, "http_guard", None) is None:  # an app not made by build_app: loopback-only admin
        install_guard(app, HttpGuard())

    def admin_error(exc: AdminError) -> JSONResponse:
        return error_response(ApiError(exc.status, str(exc)))

    @app.get("/admin/instances")
    async def instances():
        return {"instances": cluster.describe_instances()}

    @app.post("/admin/migrate", openapi_extra=openapi_body(MigrateBody))
    async def migrate(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("request_id"), str) \
                or not isinstance(body.get("to_instance"), int):
            raise ApiError(400, 'the body must be {"request_id": "<id>", "to_instance": <index>}', "request_id")
        try:
            future = cluster.migrate_now(body["request_id"], body["to_instance"], body.get("mode", "live"))
        except AdminError as exc:
            return admin_error(exc)
        result = (await asyncio.wrap_future(future)).as_dict()
        if result["outcome"] != "ok":
            return JSONResponse({**error_body(409, f"the migration did not happen: {result['outcome']}: "
                                                    f"{result['message']}"), "migration": result}, status_code=409)
        return result

    def accepted(action: Callable[..., dict], *args) -> JSONResponse:
        """An admin action that starts something: 202 with the instance's description, or its error."""
        try:
            return JSONResponse(action(*args), status_code=202)
        except AdminError as exc:
            return admin_error(exc)

    @app.post("/admin/instances/{index}/drain")
    async def drain(index: int):
        return accepted(cluster.drain, index)

    @app.post("/admin/instances/{index}/stop")
    async def stop(index: int):
        return accepted(cluster.stop_instance, index)

    @app.post("/admin/instances/{index}/restart")
    async def restart(index: int):
        return accepted(cluster.restart_instance, index)

    @app.post("/admin/instances", openapi_extra=openapi_body(AddInstanceBody))
    async def add(request: Request):
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("layout"), str):
            raise ApiError(400, 'the body must be {"layout": "tp1"} (one --instances item, e.g. decode:tp2)', "layout")
        return accepted(cluster.add_instance, body["layout"])


class DrainingServer(uvicorn.Server):
    """uvicorn, shutting down as a model server should: on SIGTERM/SIGINT (or request_shutdown())
    stop listening and answer new requests 503, let running requests finish for `grace_s`, then
    abort what is left; return instead of re-raising the signal, so the caller can exit 0.
    A second signal aborts at once."""

    def __init__(self, app: FastAPI, host: str, port: int, grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
                 on_ready: Optional[Callable[[str, int], None]] = None,
                 on_shutdown: Optional[Callable[[], None]] = None, guard: Optional[HttpGuard] = None):
        guard = guard or getattr(getattr(app, "state", None), "http_guard", None) or HttpGuard()
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=grace_s + ABORT_SLACK_S, **guard.uvicorn_ssl())
        super().__init__(config)
        self.asgi_app = app
        self.grace_s = grace_s
        self.on_ready = on_ready
        self.on_shutdown = on_shutdown
        self.port: Optional[int] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._draining = False

    @property
    def serving(self) -> Optional[ServingState]:
        state = getattr(self.asgi_app, "state", None)
        return getattr(state, "serving", None)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            self.port = self.servers[0].sockets[0].getsockname()[1]
            scheme = "https" if self.config.is_ssl else "http"
            logger.info(f"HTTP API listening on {scheme}://{self.config.host}:{self.port}")
            if self.on_ready is not None:
                self.on_ready(self.config.host, self.port)

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self._draining:
            logger.warning(f"{name} again: aborting the running requests now")
            self.force_exit = True
            if self._loop is not None and self.serving is not None:
                self._loop.call_soon_threadsafe(self.serving.abort_all, f"second {name}")
            return
        logger.info(f"{name}: shutting down (running requests get up to {self.grace_s:g} s)")
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Begin the graceful shutdown (thread-safe; what a signal does)."""
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._draining:
            return
        self._draining = True
        serving = self.serving
        if serving is not None:
            serving.begin_drain()
            self._loop.call_later(self.grace_s, serving.abort_all, f"shutdown grace period of {self.grace_s:g} s over")
        if self.on_shutdown is not None:
            try:
                self.on_shutdown()
            except Exception as exc:  # noqa: BLE001 - the drain goes on regardless
                logger.error(f"on_shutdown failed: {exc}")
        self.should_exit = True


def serve_http(app: FastAPI, host: str, port: int, on_shutdown: Optional[Callable[[], None]] = None,
               on_ready: Optional[Callable[[str, int], None]] = None,
               grace_s: float = DEFAULT_SHUTDOWN_GRACE_S, guard: Optional[HttpGuard] = None) -> None:
    """Serve `app` until SIGTERM/SIGINT, then drain (see DrainingServer) and return.

    on_ready(host, port) runs once the socket listens (port 0 picks a free one: this says which);
    on_shutdown() runs when the shutdown begins, before the running requests are drained.
    guard: its TLS settings (default: the one build_app was given)."""
    DrainingServer(app, host, port, grace_s, on_ready, on_shutdown, guard).run()

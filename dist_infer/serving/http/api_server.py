"""The OpenAI-compatible HTTP API in front of the engine (FastAPI on uvicorn).

Shaped as OpenAI and vLLM shape it, so existing clients and dashboards work unchanged:
`/v1/completions`, `/v1/chat/completions` (streamed as server-sent events or not), `/v1/models`,
`/health`, `/metrics`, and vLLM's `/tokenize` and `/detokenize`. Every response also carries the
token ids (vLLM's `return_token_ids` shape, always on): `prompt_token_ids`, and per choice
`token_ids` (in a stream: each chunk's new ids), so clients can check tokens exactly.

The engine is anything with the EngineClient interface (serving/fleet/cluster.py implements it):

    model_name: str; max_model_len: int; vocab_size: int
    tokenizer: Optional[TextTokenizer]   # None: token-id prompts only; its optional `backend`,
        # `with_bos` and `max_chars_per_token` let long prompts be refused early and encoded in processes
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

This module puts the app together; the parts live by job:

    serving/http/state.py               ServingState (what the routes share), read_json, off_loop
    serving/http/error_responses.py     what each failure means to the client (api_error_of, the handlers)
    serving/http/streams.py             one request's stream: EngineStream, EventStream, until_disconnect, sse
    serving/http/shapers.py             deltas as OpenAI's completion and chat objects (one skeleton)
    serving/http/routes.py              the generation, token and info routes
    serving/http/admin_routes.py        the admin routes over a cluster's instances
    serving/http/server.py              DrainingServer and serve_http (uvicorn, graceful shutdown)
    serving/http/connections.py         the connections' bounds (header deadline, connection cap, keep-alive)
    serving/http/prompt_size.py         a prompt refused by its length before tokenizing (PromptLimits)
    serving/http/json_body.py           a body's JSON, checked (json_of)
    serving/http/worker_pool.py         large bodies parsed and long prompts tokenized in worker processes
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI

from dist_infer.serving.http.admin_routes import add_admin_routes
from dist_infer.serving.http.error_responses import add_error_handlers, api_error_of
from dist_infer.serving.http.guard import ApiError, HttpGuard, install_guard
from dist_infer.serving.http.routes import add_generation_routes, add_info_routes, add_token_routes
from dist_infer.serving.http.server import ABORT_SLACK_S, DEFAULT_SHUTDOWN_GRACE_S, DrainingServer, serve_http
from dist_infer.serving.http.shapers import MIN_LOGPROB, ChatShaper, CompletionShaper, ResponseShaper
from dist_infer.serving.http.state import DRAINING_RETRY_AFTER_S, ServingState, StructuredOptions, off_loop, read_json
from dist_infer.serving.http.streams import (
    DISCONNECT_POLL_S,
    SSE_DONE,
    ClientGone,
    EngineStream,
    EventStream,
    close_shielded,
    sse,
    until_disconnect,
)

__all__ = [
    "ABORT_SLACK_S",
    "DEFAULT_SHUTDOWN_GRACE_S",
    "DISCONNECT_POLL_S",
    "DRAINING_RETRY_AFTER_S",
    "MIN_LOGPROB",
    "SSE_DONE",
    "ApiError",
    "ChatShaper",
    "ClientGone",
    "CompletionShaper",
    "DrainingServer",
    "EngineStream",
    "EventStream",
    "HttpGuard",
    "ResponseShaper",
    "ServingState",
    "add_admin_routes",
    "add_error_handlers",
    "api_error_of",
    "build_app",
    "close_shielded",
    "off_loop",
    "read_json",
    "serve_http",
    "sse",
    "until_disconnect",
]


def build_app(
    engine,
    served_model_name: Optional[str] = None,
    guard: HttpGuard = HttpGuard(),
    warm_workers: bool = False,
    structured: StructuredOptions = StructuredOptions(),
) -> FastAPI:
    """The FastAPI app serving `engine` (see the module docstring for the interface it needs),
    behind `guard` (keys, body limits, CORS: serving/http/guard.py), treating structured outputs
    and tools as `structured` says (serving/http/state.py)."""
    state = ServingState(engine, served_model_name, guard, structured)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if warm_workers:
            state.workers.warm()  # a server: its workers ready before the first large request
        yield
        state.close()

    app = FastAPI(title="dist_infer OpenAI-compatible API", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.serving = state
    install_guard(app, guard)
    add_error_handlers(app)
    add_generation_routes(app, state)
    add_info_routes(app, state)
    if hasattr(engine, "describe_instances"):
        add_admin_routes(app, engine)
    add_token_routes(app, state)
    return app

"""The HTTP API's routes (the admin routes: serving/http/admin_routes.py), each group registered by
its own function: generation (/v1/completions, /v1/chat/completions), tokens (/tokenize,
/detokenize) and the server's description (/v1/models, /health, /metrics)."""

from __future__ import annotations

import time
from typing import AsyncGenerator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dist_infer.engine.request import RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.structured.spec import StructuredSpec, StructuredSpecError
from dist_infer.serving.http.error_responses import api_error_of
from dist_infer.serving.http.guard import ApiError, error_body, error_response
from dist_infer.serving.http.json_body import ProtocolError
from dist_infer.serving.http.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    default_chat_max_tokens,
    openapi_body,
    parse_body,
    prompt_of,
    sampling_params_of,
)
from dist_infer.serving.http.shapers import ChatShaper, CompletionShaper, ResponseShaper
from dist_infer.serving.http.state import ServingState, off_loop
from dist_infer.serving.http.streams import SSE_DONE, EngineStream, EventStream, close_shielded, sse, until_disconnect
from dist_infer.serving.http.tools import ToolPlan

# -- generation ---------------------------------------------------------------------------------------


async def sse_events(
    stream: EngineStream,
    shaper: ResponseShaper,
    first: Optional[RequestOutput],
    include_usage: bool,
    continuous_usage: bool,
) -> AsyncGenerator[str, None]:
    try:
        for opening in shaper.opening_chunks():
            yield sse(opening)
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


async def respond(request: Request, stream: EngineStream, shaper: ResponseShaper, body) -> Response:
    """Run the request: as server-sent events (once its first delta came: an engine that refuses
    it still answers with a status) or as one JSON response."""
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


async def complete(state: ServingState, request: Request) -> Response:
    arrival = time.monotonic()
    state.check_accepting()
    body: CompletionRequest = parse_body(CompletionRequest, await state.read_json(request))
    state.check_model(body.model)
    state.limits.check_completion_prompt(body.prompt)
    prompt = prompt_of(body.prompt)
    if isinstance(prompt, str):
        state.need_tokenizer("prompt", "a text prompt")
        prompt_ids = await state.encode(prompt, True, "prompt", state.engine.max_model_len)
    else:
        prompt_ids = prompt
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    field, structured = body.structured() or (None, None)
    params = sampling_params_of(body, max_tokens, state.tokenizer is not None, structured)
    params = state.isolated(params, request)
    state.engine.check_request(prompt_ids, params)
    await state.check_structured(params, field)
    stream = state.open_stream("cmpl", prompt_ids, params, arrival)
    return await respond(request, stream, CompletionShaper(state, stream.request_id, prompt_ids, params.logprobs), body)


def chat_params(
    state: ServingState, body: ChatCompletionRequest, prompt_ids: list[int], structured: Optional[StructuredSpec]
) -> SamplingParams:
    """The chat request's sampling parameters, checked; a defaulted max_tokens fills the model."""
    max_tokens = body.requested_max_tokens
    if max_tokens is not None:
        params = sampling_params_of(body, max_tokens, True, structured)
        state.engine.check_request(prompt_ids, params)
        return params
    max_len = state.engine.max_model_len
    max_tokens = default_chat_max_tokens(len(prompt_ids), max_len)
    if max_tokens < 1:
        raise ApiError(
            400,
            f"the messages make a prompt of {len(prompt_ids)} tokens; the model has {max_len} positions",
            "messages",
        )
    return state.fit_default_max_tokens(prompt_ids, sampling_params_of(body, max_tokens, True, structured))


def chat_structure(
    body: ChatCompletionRequest, tools: Optional[ToolPlan]
) -> tuple[Optional[str], Optional[StructuredSpec]]:
    """What the reply must look like, and the field that asks: the body's structured output, or
    what its tool_choice requires (both at once is a 400: two grammars for one reply)."""
    asked = body.structured()
    schema = tools.output_schema() if tools is not None else None
    if tools is None or schema is None:
        return asked or (None, None)
    if asked is not None:
        raise ProtocolError(
            "tool_choice", f"tool_choice {tools.choice!r} and a structured output each ask for a structure; send one"
        )
    try:
        return "tools", StructuredSpec.from_kind("json_schema", schema)
    except StructuredSpecError as exc:
        raise ProtocolError("tools", f"tools: {exc}") from None


async def chat_complete(state: ServingState, request: Request) -> Response:
    arrival = time.monotonic()
    state.check_accepting()
    body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await state.read_json(request))
    state.check_model(body.model)
    state.need_tokenizer("messages", "chat")
    tools = body.tool_plan(state.tool_parser)
    field, structured = chat_structure(body, tools)
    text = await state.render_chat(
        body.messages, bool(body.add_generation_prompt), body.chat_template_kwargs, tools=tools
    )
    prompt_ids = await state.encode(text, True, "messages", state.engine.max_model_len)
    params = state.isolated(chat_params(state, body, prompt_ids, structured), request)
    await state.check_structured(params, field)
    stream = state.open_stream("chatcmpl", prompt_ids, params, arrival)
    shaper = ChatShaper(state, stream.request_id, prompt_ids, params.logprobs, tools=tools)
    return await respond(request, stream, shaper, body)


def add_generation_routes(app: FastAPI, state: ServingState) -> None:
    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request):
        return await complete(state, request)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        return await chat_complete(state, request)


# -- the rest -----------------------------------------------------------------------------------------


def add_info_routes(app: FastAPI, state: ServingState) -> None:
    """/v1/models, /health and /metrics."""
    engine = state.engine

    @app.get("/v1/models")
    async def models():
        card = {
            "id": state.served_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "dist_infer",
            "root": engine.model_name,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [],
        }
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


def add_token_routes(app: FastAPI, state: ServingState) -> None:
    """vLLM's /tokenize and /detokenize."""
    engine = state.engine

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request):
        body: TokenizeRequest = parse_body(TokenizeRequest, await state.read_json(request))
        state.check_model(body.model)
        if body.messages is not None:  # any length, as vLLM's /tokenize answers: the count may exceed the model's
            state.need_tokenizer("messages", "tokenize")
            text = await state.render_chat(body.messages, bool(body.add_generation_prompt), check_size=False)
            ids = await state.encode(text, True, "messages", None)
        elif body.prompt is not None:
            state.need_tokenizer("prompt", "tokenize")
            ids = await state.encode(body.prompt, bool(body.add_special_tokens), "prompt", None)
        else:
            raise ApiError(400, "send prompt or messages", "prompt")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request):
        body: DetokenizeRequest = parse_body(DetokenizeRequest, await state.read_json(request))
        state.check_model(body.model)
        tok = state.need_tokenizer("tokens", "detokenize")
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise ApiError(400, f"tokens has ids {bad[:5]} outside the vocabulary of {engine.vocab_size}", "tokens")
        return {"prompt": await off_loop(tok.decode, body.tokens)}

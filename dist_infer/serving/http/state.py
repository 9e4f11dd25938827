"""What the HTTP API's routes share (ServingState), and their small helpers."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import uuid
from typing import Any, Callable, Optional, Union

from fastapi import Request
from loguru import logger

from dist_infer.engine.request import RequestError
from dist_infer.engine.sampling import SamplingParams, SamplingParamsError
from dist_infer.engine.structured.compiler import GrammarCompiler
from dist_infer.engine.structured.spec import StructuredSpecError
from dist_infer.serving.http.cache_isolation import CacheIsolation
from dist_infer.serving.http.chat import ChatRenderer
from dist_infer.serving.http.guard import ApiError, HttpGuard, bearer_token
from dist_infer.serving.http.json_body import ProtocolError, json_of
from dist_infer.serving.http.metrics import ServingMetrics
from dist_infer.serving.http.prompt_size import PromptLimits
from dist_infer.serving.http.streams import EngineStream
from dist_infer.serving.http.tools import ToolPlan
from dist_infer.serving.http.worker_pool import POOL_MIN_BODY_BYTES, POOL_MIN_CHARS, WorkerPool, WorkersUnavailable

DRAINING_RETRY_AFTER_S = 5.0
OFF_LOOP_JSON_BYTES = 1 << 16  # a body from this size is parsed off the loop (a thread; a worker from 2 MiB)


def grammars_of(engine) -> GrammarCompiler:
    """The engine's own grammar compiler (an in-process Engine), else one for the front end, built
    from the tokenizer the first time a structured request comes."""
    own = getattr(engine, "grammars", None)
    if isinstance(own, GrammarCompiler):
        return own
    tokenizer = engine.tokenizer
    eos = [i for i in (getattr(tokenizer, "eos_id", None),) if isinstance(i, int)]
    vocab_size: int = getattr(engine, "vocab_size", None) or getattr(tokenizer, "vocab_size", None) or 0
    return GrammarCompiler(None if tokenizer is None else (lambda: tokenizer), vocab_size, eos)


@dataclasses.dataclass(frozen=True)
class StructuredOptions:
    """How the API treats structured outputs and tools: `tool_parser`, the format `tool_choice:
    auto` replies are read in (serving/http/tool_call_parsing.py); `max_grammar_compile_s`, how
    long checking a new spec's grammar may take before its request is refused."""

    tool_parser: str = "hermes"
    max_grammar_compile_s: float = 10.0


SLOW_SPECS_KEPT = 1024  # specs refused for a slow compile, remembered so a repeat is refused at once


class ServingState:
    """What the endpoints share: the engine, the names the model answers to, the chat renderer,
    the metrics, the prefix cache's isolation, the requests in flight, and whether the server is
    draining for shutdown."""

    def __init__(
        self,
        engine,
        served_model_name: Optional[str],
        guard: HttpGuard = HttpGuard(),
        structured: StructuredOptions = StructuredOptions(),
    ):
        self.engine = engine
        self.tool_parser = structured.tool_parser  # the format `tool_choice: auto` replies are read in
        self.max_grammar_compile_s = structured.max_grammar_compile_s
        self.slow_specs: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.served_name = served_model_name or engine.model_name
        self.model_names = {self.served_name, engine.model_name}
        self.metrics = ServingMetrics(
            self.served_name, engine.stats, engine.max_model_len, prefix_cache_counters=guard.open_prefix_cache_metrics
        )
        self.cache_isolation = CacheIsolation(guard.cache_isolation_mode)  # its secret: this serve job's
        self.renderer = ChatRenderer.for_tokenizer(engine.chat_template, engine.tokenizer)
        self.limits = PromptLimits.of(engine.max_model_len, engine.tokenizer)
        self.workers = WorkerPool(getattr(engine.tokenizer, "backend", None))
        self.grammars = grammars_of(engine)
        self.grammars.warm()  # the model's vocabulary for llguidance, built before the first schema comes
        self.active: dict[str, EngineStream] = {}
        self.draining = False
        if self.limits.max_chars is not None:
            logger.info(
                f"prompts over {self.limits.max_chars:,} characters ({engine.max_model_len} tokens of at most "
                f"{self.limits.chars_per_token} characters) are refused before tokenizing"
            )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.model_names:
            raise ApiError(400, f"model {model!r} is not served here; this server serves {self.served_name!r}", "model")

    def check_accepting(self) -> None:
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down and takes no new requests",
                None,
                {"Retry-After": str(int(DRAINING_RETRY_AFTER_S))},
            )

    def need_tokenizer(self, field: str, what: str) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, f"{what} needs a tokenizer and this model has none; send token ids", field)
        return self.tokenizer

    async def encode(self, text: str, add_bos: bool, field: str, limit: Optional[int]) -> list[int]:
        """The ids of a prompt's text, encoded where the event loop does not wait on it: in a worker
        process when it is long (the caller has checked its characters), else in a thread. Over
        `limit` tokens it is refused by its count (None: any count, as /tokenize answers)."""
        tokenizer = self.tokenizer
        ids: Optional[list[int]] = None
        if self.workers.can_encode and len(text) >= POOL_MIN_CHARS:
            found: Union[list[int], int, None] = None
            try:
                found = await self.workers.encode(text, limit)
            except WorkersUnavailable:
                pass
            if isinstance(found, int):  # its count, over `limit` (the model's length: refused here)
                self.limits.check_tokens(found, field)
            elif found is not None:
                ids = tokenizer.with_bos(found, add_bos)
        if ids is None:
            ids = await off_loop(tokenizer.encode, text, add_bos=add_bos)
        if limit is not None:
            self.limits.check_tokens(len(ids), field)
        return ids

    async def render_chat(
        self,
        messages: Any,
        add_generation_prompt: bool,
        extra: Optional[dict[str, Any]] = None,
        check_size: bool = True,
        tools: Optional[ToolPlan] = None,
    ) -> str:
        """The chat prompt's text, rendered in a thread; refused first if its contents alone cannot fit."""

        def render() -> str:
            if check_size:
                self.limits.check_messages(messages)
            return self.renderer.render(messages, add_generation_prompt, extra, tools)

        return await off_loop(render)

    async def check_structured(self, params: SamplingParams, field: Optional[str]) -> None:
        """A structured request's grammar checked against the model's vocabulary (compiled once per
        spec, in a thread): a 400 naming the body's `field`, before anything is queued. A check
        that takes over max_grammar_compile_s is a 400 too (the compile finishes in its thread,
        bounded by the grammar limits; the spec is remembered and refused at once from then on)."""
        if params.structured is None:
            return
        key = params.structured.key()
        slow = ProtocolError(
            field,
            f"{field}: compiling its grammar took over {self.max_grammar_compile_s:g} s (--max-grammar-compile-s)",
        )
        if key in self.slow_specs:
            self.slow_specs.move_to_end(key)
            raise slow
        check = asyncio.ensure_future(off_loop(self.grammars.validate, params.structured))
        try:
            await asyncio.wait_for(asyncio.shield(check), self.max_grammar_compile_s)
        except StructuredSpecError as exc:
            raise ProtocolError(field, f"{field}: {exc}") from None
        except asyncio.TimeoutError:
            check.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved: no warning
            self.slow_specs[key] = None
            while len(self.slow_specs) > SLOW_SPECS_KEPT:
                self.slow_specs.popitem(last=False)
            raise slow from None

    async def read_json(self, request: Request) -> Any:
        """The body's JSON, parsed where the event loop does not wait on it when it is large: in a
        thread (checking its values walks all of them), in a worker from POOL_MIN_BODY_BYTES."""
        raw = await request.body()
        if len(raw) >= POOL_MIN_BODY_BYTES:
            try:
                return await self.workers.parse_json(raw)
            except WorkersUnavailable:
                pass
        return await parse_json(raw)

    def close(self) -> None:
        """What the app holds beyond its requests: the worker processes."""
        self.workers.close()

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

    def isolated(self, params: SamplingParams, request: Request) -> SamplingParams:
        """`params` with the cache salt the engine hashes the prompt with: the request's own
        cache_salt, mixed with its API key's salt under --prefix-cache-isolation key."""
        salt = self.cache_isolation.cache_salt(bearer_token(request.headers), params.cache_salt)
        return params if salt == params.cache_salt else dataclasses.replace(params, cache_salt=salt)

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
    """The body's JSON, as the app's ServingState reads it (off the loop when large); an app
    without one (the admin routes on their own) parses it in a thread when large."""
    serving = getattr(request.app.state, "serving", None)
    if serving is not None:
        return await serving.read_json(request)
    return await parse_json(await request.body())


async def parse_json(raw: bytes) -> Any:
    """json_body.json_of(raw): on the loop when small, in a thread from OFF_LOOP_JSON_BYTES."""
    return json_of(raw) if len(raw) < OFF_LOOP_JSON_BYTES else await off_loop(json_of, raw)


async def off_loop(fn: Callable, *args, **kwargs) -> Any:
    """Tokenizing or templating a long prompt, in a thread: the event loop keeps answering meanwhile."""
    return await asyncio.to_thread(fn, *args, **kwargs)

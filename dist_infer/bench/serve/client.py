"""The HTTP side of bench-serve: one streamed request per BenchRequest at its arrival time, with
when every content chunk arrives (TTFT, ITL, E2E) recorded as it comes.

Speaks only the OpenAI streaming format (SSE `data:` lines, `[DONE]`), so any compatible server
can be measured; vLLM-style extras (`token_ids`, usage in every chunk) sharpen the token counts
when present. Keys (--api-key or the environment) and TLS (--insecure, --ca-cert) are set here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import ssl
import time
from typing import Any, AsyncIterator, Callable, NamedTuple, Optional, Sequence, Union

from loguru import logger

from dist_infer.bench.serve.datasets import BenchRequest
from dist_infer.bench.serve.flags import ENDPOINT_PATHS, InputError
from dist_infer.bench.serve.json_schemas import check_answer, response_format

API_KEY_ENVS = ("OPENAI_API_KEY", "DIST_INFER_API_KEY")  # where --api-key comes from when not given


def request_payload(
    request: BenchRequest, model: str, endpoint: str, ignore_eos: bool, temperature: float = 0.0
) -> dict[str, Any]:
    """The JSON body: streamed, at `temperature` (greedy by default), max_tokens = the request's
    output length, and its schema as a strict json_schema response_format if it has one."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":  # a list prompt on chat is a whole conversation's messages (multi-turn)
        body["messages"] = (
            request.prompt if isinstance(request.prompt, list) else [{"role": "user", "content": request.prompt}]
        )
    else:
        body["prompt"] = request.prompt
    body.update(
        {
            "max_tokens": request.output_len,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    if ignore_eos:
        body["ignore_eos"] = True
    if request.schema is not None:
        body["response_format"] = response_format(request.schema)
    return body


class SSELine(NamedTuple):
    """One line of an event stream: kind is 'data' (with the decoded JSON), 'done' or 'skip'."""

    kind: str
    data: Optional[dict] = None


def parse_sse_line(line: str) -> SSELine:
    """Decode one SSE line. Blank lines, comments (`: ping`) and other fields are 'skip';
    `data: [DONE]` ends the stream; other data must be a JSON object (ValueError if not)."""
    line = line.strip("\r\n")
    if not line.startswith("data:"):
        return SSELine("skip")
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return SSELine("done")
    if not payload:
        return SSELine("skip")
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        raise ValueError(f"undecodable event data: {payload[:200]!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"event data is not a JSON object: {payload[:200]!r}")
    return SSELine("data", data)


class ChunkContent(NamedTuple):
    """What one streamed chunk carries."""

    text: str
    tokens: int  # new tokens in this chunk: len(token_ids), else the usage increase, else 1 if text
    completion_tokens: Optional[int]  # usage.completion_tokens if the chunk has usage
    prompt_tokens: Optional[int]
    error: Optional[str]
    token_ids: Optional[list[int]] = None  # the new ids, when the server sends them (vLLM's return_token_ids)
    finish_reason: Optional[str] = None  # on the chunk that ends the choice


def chunk_content(event: dict, completion_tokens_so_far: Optional[int] = None) -> ChunkContent:
    """Text and token count of one completions or chat chunk (an in-stream error is reported too)."""
    if event.get("error"):
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        return ChunkContent("", 0, None, None, f"error in stream: {message}")
    usage = event.get("usage") if isinstance(event.get("usage"), dict) else {}
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    text, token_ids, finish = "", None, None
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        finish = choice.get("finish_reason") or finish
        delta = choice.get("delta") or choice.get("message")  # message: a whole non-streamed chat answer
        delta = delta if isinstance(delta, dict) else {}
        piece = choice.get("text") if "text" in choice else (delta.get("content") or delta.get("reasoning_content"))
        text += piece or ""
        ids = choice.get("token_ids") or delta.get("token_ids")
        if isinstance(ids, list):
            token_ids = (token_ids or []) + ids
    if token_ids is not None:
        tokens = len(token_ids)
    elif text and isinstance(completion, int) and isinstance(completion_tokens_so_far, int):
        tokens = max(1, completion - completion_tokens_so_far)  # usage in every chunk (vLLM continuous stats)
    else:
        tokens = 1 if text else 0
    return ChunkContent(
        text,
        tokens,
        completion if isinstance(completion, int) else None,
        prompt if isinstance(prompt, int) else None,
        None,
        token_ids,
        finish if isinstance(finish, str) else None,
    )


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Gaps between content chunks; a chunk of k tokens adds k gaps of (its gap / k), so ITL
    stays per token when a server batches tokens into one chunk."""
    itl = []
    for i in range(1, len(chunk_times)):
        gap = chunk_times[i] - chunk_times[i - 1]
        k = max(1, int(chunk_tokens[i]))
        itl.extend([gap / k] * k)
    return itl


@dataclasses.dataclass
class RequestRecord:
    """What happened to one request; times in seconds, send/chunk times relative to the run's start."""

    index: int
    input_len: int
    output_len: int  # max_tokens asked for
    send_time: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_tokens: list[int] = dataclasses.field(default_factory=list)
    ttft: Optional[float] = None
    itl: list[float] = dataclasses.field(default_factory=list)
    e2e: Optional[float] = None
    output_tokens: int = 0
    prompt_tokens: Optional[int] = None  # as the server's usage reports it
    success: bool = False
    error: str = ""
    conversation: Optional[int] = None  # multi-turn runs: which conversation (0-based) and turn (1-based)
    turn: Optional[int] = None
    finish_reason: Optional[str] = None  # as the last chunk says
    schema_valid: Optional[bool] = None  # --dataset json-schema: the answer is an instance of its schema
    schema_error: str = ""  # why not

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first; None with fewer than 2 tokens."""
        if not self.success or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclasses.dataclass
class Answer:
    """What a request generated, kept apart from its RequestRecord (whose --save-results stay small)
    for multi-turn runs, where the answer goes into the next turn's prompt."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    ids_complete: bool = True  # every content chunk carried its token ids

    def add(self, content: ChunkContent) -> None:
        """Append one chunk's text and ids."""
        self.text += content.text
        if content.token_ids is not None:
            self.token_ids += [int(i) for i in content.token_ids]
        elif content.text:
            self.ids_complete = False


def api_key_of(flag: Optional[str], environ: Optional[dict] = None) -> Optional[str]:
    """--api-key, else the first of API_KEY_ENVS that is set."""
    environ = os.environ if environ is None else environ
    return flag or next((environ[name] for name in API_KEY_ENVS if environ.get(name)), None)


def tls_verify_of(insecure: bool, ca_cert: Optional[str]) -> Union[bool, ssl.SSLContext]:
    """httpx's `verify`: off with --insecure, a context trusting --ca-cert, else the system's CAs."""
    if insecure:
        return False
    if ca_cert:
        try:
            return ssl.create_default_context(cafile=ca_cert)
        except (OSError, ssl.SSLError) as exc:
            raise InputError(f"--ca-cert {ca_cert}: {exc}") from None
    return True


def normalized_base_url(url: str) -> str:
    """Without a trailing slash or /v1, so endpoint paths can be appended."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def default_model(client, base_url: str) -> str:
    """The first model id of GET /v1/models."""
    try:
        response = await client.get(base_url + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
        return str(models[0]["id"])
    except Exception as exc:
        raise InputError(
            f"cannot read the model name from {base_url}/v1/models ({type(exc).__name__}: {exc}); pass --model"
        ) from None


async def stream_request(
    client, url: str, payload: dict, record: RequestRecord, start: float, answer: Optional[Answer] = None
) -> None:
    """Send one streamed request, filling `record` (and `answer`, if given) as chunks arrive (so a
    timeout keeps what came)."""
    sent = time.perf_counter()
    record.send_time = sent - start
    completion_tokens: Optional[int] = None
    counted_tokens = 0
    ended: Optional[float] = None  # when [DONE] came
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", errors="replace")
            record.error = f"HTTP {response.status_code}: {body.strip()[:2000]}"
            record.e2e = time.perf_counter() - sent
            return
        if response.headers.get("content-type", "").startswith("application/json"):
            lines = ["data: " + (await response.aread()).decode("utf-8", errors="replace"), "data: [DONE]"]
            source = _as_async(lines)  # a server that ignored stream: true; one chunk with everything
        else:
            source = response.aiter_lines()
        async for line in source:
            now = time.perf_counter()
            try:
                event = parse_sse_line(line)
            except ValueError as exc:
                record.error = str(exc)
                record.e2e = now - sent
                return
            if event.kind == "done":
                ended = now
                break
            if event.kind != "data":
                continue
            content = chunk_content(event.data, completion_tokens)
            if content.error:
                record.error = content.error
                record.e2e = now - sent
                return
            if content.completion_tokens is not None:
                completion_tokens = content.completion_tokens
            if content.prompt_tokens is not None:
                record.prompt_tokens = content.prompt_tokens
            if answer is not None:
                answer.add(content)
            record.finish_reason = content.finish_reason or record.finish_reason
            if content.tokens or content.text:
                if record.ttft is None:
                    record.ttft = now - sent
                record.chunk_times.append(now - start)
                record.chunk_tokens.append(content.tokens)
                counted_tokens += content.tokens
    record.e2e = (ended if ended is not None else time.perf_counter()) - sent
    record.output_tokens = completion_tokens if completion_tokens is not None else counted_tokens
    record.itl = inter_token_latencies(record.chunk_times, record.chunk_tokens)
    if ended is None and not record.chunk_times:
        record.error = "stream ended with no content and no [DONE]"
        return
    record.success = True


async def _as_async(items):
    """A list as an async iterator, so a non-streamed body goes through the same loop as a stream."""
    for item in items:
        yield item


@dataclasses.dataclass
class Session:
    """One run's HTTP client and what every request of the run shares."""

    client: Any  # httpx.AsyncClient
    base_url: str
    model: str
    url: str  # the endpoint's URL
    slots: Optional[asyncio.Semaphore]  # --max-concurrency
    timeout_s: float
    start: float = 0.0  # perf_counter at the run's start; send and chunk times are relative to it

    def now(self) -> float:
        """Seconds since the run's start."""
        return time.perf_counter() - self.start


@contextlib.asynccontextmanager
async def open_session(
    base_url: str,
    model: Optional[str],
    endpoint: str,
    max_concurrency: Optional[int],
    timeout_s: float,
    api_key: Optional[str] = None,
    verify: Union[bool, ssl.SSLContext] = True,
) -> AsyncIterator[Session]:
    """An HTTP client for the run, with the model resolved (the first of /v1/models when None).
    api_key: sent as a Bearer token; verify: httpx's TLS verification (see tls_verify_of)."""
    try:
        import httpx
    except ImportError:
        raise InputError("bench-serve needs httpx: pip install httpx (or dist_infer[serve])") from None

    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    deadline = None if math.isinf(timeout_s) else timeout_s
    # trust_env=False: a benchmark must reach the server directly, not through an HTTP(S)_PROXY
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(deadline), limits=limits, trust_env=False, headers=headers, verify=verify
    ) as client:
        if model is None:
            model = await default_model(client, base_url)
            logger.info(f"model {model!r} (first of {base_url}/v1/models)")
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        yield Session(
            client, base_url, model, base_url + ENDPOINT_PATHS[endpoint], slots, timeout_s, time.perf_counter()
        )


async def send_request(
    session: Session, payload: dict, record: RequestRecord, answer: Optional[Answer] = None
) -> RequestRecord:
    """Send one request now (after a --max-concurrency slot frees), turning timeouts and transport
    errors into the record's error."""
    import httpx

    deadline = None if math.isinf(session.timeout_s) else session.timeout_s
    if session.slots is not None:
        await session.slots.acquire()
    try:
        await asyncio.wait_for(
            stream_request(session.client, session.url, payload, record, session.start, answer), deadline
        )
    except asyncio.TimeoutError:
        record.error = f"timed out after {session.timeout_s:g} s"
    except (httpx.HTTPError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        if session.slots is not None:
            session.slots.release()
    if not record.success and record.e2e is None:
        record.e2e = session.now() - record.send_time
    return record


async def run_requests(
    session: Session,
    requests: Sequence[BenchRequest],
    endpoint: str,
    ignore_eos: bool,
    progress: Optional[Callable[[RequestRecord], None]] = None,
    temperature: float = 0.0,
) -> list[RequestRecord]:
    """Send every request at its arrival time (relative to session.start); the records in request
    order. A request with a schema has its answer checked against it (`schema_error`)."""

    async def one(request: BenchRequest) -> RequestRecord:
        record = RequestRecord(request.index, request.input_len, request.output_len)
        delay = request.arrival_s - session.now()
        if delay > 0:
            await asyncio.sleep(delay)
        answer = Answer() if request.schema is not None else None
        payload = request_payload(request, session.model, endpoint, ignore_eos, temperature)
        await send_request(session, payload, record, answer)
        if answer is not None and record.success:
            record.schema_error = check_answer(answer.text, request.schema.schema) or ""
            record.schema_valid = not record.schema_error
        if progress is not None:
            progress(record)
        return record

    return list(await asyncio.gather(*(one(request) for request in requests)))


async def run_load(
    requests: Sequence[BenchRequest],
    base_url: str,
    model: Optional[str],
    endpoint: str,
    ignore_eos: bool,
    max_concurrency: Optional[int],
    timeout_s: float,
    progress: Optional[Callable[[RequestRecord], None]] = None,
    api_key: Optional[str] = None,
    verify: Union[bool, ssl.SSLContext] = True,
) -> tuple[list[RequestRecord], float, str]:
    """Send every request at its arrival time; returns the records, the run's duration and the model."""
    async with open_session(base_url, model, endpoint, max_concurrency, timeout_s, api_key, verify) as session:
        session.start = time.perf_counter()
        records = await run_requests(session, requests, endpoint, ignore_eos, progress)
        return records, session.now(), session.model

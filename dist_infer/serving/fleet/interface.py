"""What the HTTP side may know of the fleet, and all it may import from it: the EngineClient
interface its routes call (Cluster implements it) and the errors the fleet raises, which the HTTP
side turns into status codes. tests/unit/test_architecture.py keeps serving/http to this module."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Optional, Protocol

if TYPE_CHECKING:
    from dist_infer.engine.request import RequestOutput
    from dist_infer.engine.sampling import SamplingParams


class EngineClient(Protocol):
    """One instance or many behind the API. check_request raises RequestError(field, message);
    generate raises QueueFullError (503 with Retry-After) or EngineDeadError (500); abort is
    thread-safe and idempotent; stats() has num_requests_running, ..., free_blocks, total_blocks.
    A fleet with admin operations (describe_instances, ...) also gets the /admin routes."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: object  # a TextTokenizer, or None: token-id prompts only
    chat_template: Optional[str]
    dead_reason: Optional[str]

    def check_request(self, prompt_token_ids: list[int], params: "SamplingParams") -> None: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: "SamplingParams"
    ) -> AsyncIterator["RequestOutput"]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...

    def begin_shutdown(self) -> None: ...


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit (or the server is shutting down); the client should
    retry after `retry_after_s` seconds (HTTP 503 with a Retry-After header)."""

    def __init__(self, retry_after_s: float = 1.0, message: str = ""):
        super().__init__(message or f"the server is busy: too many requests waiting; retry after {retry_after_s:g} s")
        self.retry_after_s = float(retry_after_s)


class EngineDeadError(RuntimeError):
    """The engine stopped (a rank died, a collective timed out); no request can be served any
    more (HTTP 500, or an error event in a stream). The message says why."""


class RequestFailedError(EngineDeadError):
    """One request failed inside its instance (a step raised for it; or the instances running it
    kept dying): that request ends with HTTP 500 or an error event naming it; the server serves on."""


class AdminError(ValueError):
    """An admin request that cannot be done; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

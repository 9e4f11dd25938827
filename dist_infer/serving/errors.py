"""Why the engine refused or dropped a request: shared by the engine bridge (which raises) and
the HTTP server (which turns each into its status code), so neither imports the other."""

from __future__ import annotations


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

"""Serving an app on uvicorn and shutting down as a model server should (DrainingServer, serve_http)."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING, Callable, Optional

import uvicorn
from fastapi import FastAPI
from loguru import logger

from dist_infer.serving.http.connections import uvicorn_connection_options
from dist_infer.serving.http.guard import HttpGuard

if TYPE_CHECKING:
    from dist_infer.serving.http.state import ServingState

DEFAULT_SHUTDOWN_GRACE_S = 30.0  # running requests get this long to finish after SIGTERM, then are aborted
ABORT_SLACK_S = 5.0  # after aborting, this long for the aborted streams to end before uvicorn cancels them


class DrainingServer(uvicorn.Server):
    """uvicorn, shutting down as a model server should: on SIGTERM/SIGINT (or request_shutdown())
    stop listening and answer new requests 503, let running requests finish for `grace_s`, then
    abort what is left; return instead of re-raising the signal, so the caller can exit 0.
    A second signal aborts at once."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
        on_ready: Optional[Callable[[str, int], None]] = None,
        on_shutdown: Optional[Callable[[], None]] = None,
        guard: Optional[HttpGuard] = None,
    ):
        guard = guard or getattr(getattr(app, "state", None), "http_guard", None) or HttpGuard()
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            # (uvicorn annotates it int; it is asyncio.wait_for's timeout, a float)
            timeout_graceful_shutdown=grace_s + ABORT_SLACK_S,  # type: ignore[arg-type]
            **guard.uvicorn_ssl(),
            **uvicorn_connection_options(guard),
        )
        super().__init__(config)
        self.asgi_app = app
        self.grace_s = grace_s
        self.on_ready = on_ready
        self.on_shutdown = on_shutdown
        self.port: Optional[int] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._draining = False

    @property
    def serving(self) -> Optional["ServingState"]:
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
            asyncio.get_running_loop().call_later(
                self.grace_s, serving.abort_all, f"shutdown grace period of {self.grace_s:g} s over"
            )
        if self.on_shutdown is not None:
            try:
                self.on_shutdown()
            except Exception as exc:  # noqa: BLE001 - the drain goes on regardless
                logger.error(f"on_shutdown failed: {exc}")
        self.should_exit = True


def serve_http(
    app: FastAPI,
    host: str,
    port: int,
    on_shutdown: Optional[Callable[[], None]] = None,
    on_ready: Optional[Callable[[str, int], None]] = None,
    grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
    guard: Optional[HttpGuard] = None,
) -> None:
    """Serve `app` until SIGTERM/SIGINT, then drain (see DrainingServer) and return.

    on_ready(host, port) runs once the socket listens (port 0 picks a free one: this says which);
    on_shutdown() runs when the shutdown begins, before the running requests are drained.
    guard: its TLS settings and connection bounds (default: the one build_app was given)."""
    DrainingServer(app, host, port, grace_s, on_ready, on_shutdown, guard).run()

"""Bounds on the HTTP connections themselves, before any request reaches the app: how many may be
open, how long a client may take to send a request's head, how long an idle one is kept.

uvicorn bounds idle keep-alive connections (timeout_keep_alive) and answers 503 past
limit_concurrency, but only once a request's head is complete: a client that sends its head one
byte at a time, or nothing at all, holds its connection (and a file descriptor) for ever. So the
server runs uvicorn's h11 protocol with two additions (`BoundedH11Protocol`):

- a header deadline: whenever a connection waits for a request head (from the moment it opens, and
  again from the end of each response) the whole head must arrive within `header_timeout_s`, or the
  connection is closed. It is a timer per connection, armed and cancelled as uvicorn's own
  keep-alive timer is.
- a connection cap: a connection past `max_connections` is answered 503 and closed at once, so
  slow clients cannot pile up connections while their deadlines run.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dist_infer.serving.http.guard import error_body

if TYPE_CHECKING:
    from dist_infer.serving.http.guard import HttpGuard

REFUSAL_LOG_INTERVAL_S = 10.0  # one warning at most this often while refusing (a flood must not flood the log)


def _refusal(max_connections: int) -> bytes:
    """The raw 503 a connection past the cap gets: it is sent before any request is read, so
    not through h11, which answers only a request it has parsed."""
    body = json.dumps(
        error_body(
            503,
            f"the server has its maximum of {max_connections} connections open; retry later",
            None,
            "too_many_connections",
        )
    ).encode()
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\nretry-after: 1\r\n\r\n"
    )
    return head.encode("latin-1") + body


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head and a cap on open connections
    (bounded_protocol() makes the subclass that carries the settings)."""

    header_timeout_s: float = 30.0
    max_connections: int = 1024
    _last_refusal_log = -REFUSAL_LOG_INTERVAL_S  # shared by the connections of one server (class attribute)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_deadline: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._refuse()
            return
        self._arm_header_deadline()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        """uvicorn's event loop over what h11 parsed; then the deadline runs exactly while the
        connection waits for a request head (h11's client state IDLE)."""
        super().handle_events()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self.header_deadline is None:
                self._arm_header_deadline()
        else:
            self._cancel_header_deadline()

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self.header_deadline = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _cancel_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _header_timed_out(self) -> None:
        self.header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.debug(
                "closing a connection whose request head did not arrive within %g s", self.header_timeout_s
            )
            self.transport.close()

    def _refuse(self) -> None:
        """Answer 503 and close; the connection stops counting at once, so that a flood of refused
        ones cannot make uvicorn's own limit refuse the requests of admitted ones."""
        self.connections.discard(self)
        now = time.monotonic()
        cls = type(self)
        if now - cls._last_refusal_log >= REFUSAL_LOG_INTERVAL_S:
            cls._last_refusal_log = now
            self.logger.warning(
                "%d connections open (--max-connections): refusing more with 503 (logged at most every %g s)",
                self.max_connections,
                REFUSAL_LOG_INTERVAL_S,
            )
        self.transport.write(_refusal(self.max_connections))
        self.transport.close()


def bounded_protocol(header_timeout_s: float, max_connections: int) -> type[BoundedH11Protocol]:
    """A BoundedH11Protocol subclass with these settings (uvicorn makes each connection's protocol
    from a class and its Config alone)."""
    return type(
        "BoundedH11Protocol",
        (BoundedH11Protocol,),
        {
            "header_timeout_s": header_timeout_s,
            "max_connections": max_connections,
            "_last_refusal_log": -REFUSAL_LOG_INTERVAL_S,
        },
    )


def uvicorn_connection_options(guard: "HttpGuard") -> dict[str, Any]:
    """uvicorn.Config's keyword arguments for the guard's connection bounds."""
    return {
        "http": bounded_protocol(guard.header_timeout_s, guard.max_connections),
        "timeout_keep_alive": guard.keep_alive_timeout_s,
        # uvicorn refuses a request while len(connections) >= limit, counting the asking connection
        # itself: + 1 lets every admitted connection be answered. It still bounds the running
        # requests (which can outlive their connections) at max_connections + 1.
        "limit_concurrency": guard.max_connections + 1,
    }

"""The HTTP connections' bounds (serving/http/connections.py, cli/http_flags.py): a request head
that does not arrive within --header-timeout closes its connection (before, connections
sending one header byte every 8 s stayed open for ever), idle keep-alive connections close after
--keep-alive-timeout, and a connection past --max-connections gets 503 at once.

The server is uvicorn on 127.0.0.1 in a thread of this process; the slow clients are raw sockets.
Every wait polls a condition under a deadline many times the timeout it checks.
"""

from __future__ import annotations

import argparse
import http.client
import math
import select
import socket
import threading
import time

import httpx
import pytest

from dist_infer.cli.http_flags import add_http_flags, http_options_of
from dist_infer.serving.http.api_server import DrainingServer, build_app
from dist_infer.serving.http.guard import HttpGuard
from tests.support.fake_engine import MODEL, FakeEngine
from tests.support.polling import wait_until

DEADLINE_S = 20.0  # how long a test waits for a connection to close; the timeouts under test are 1-2 s
SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200  # never ends in the tests


def serve(guard: HttpGuard):
    """The API in front of the fake engine, on uvicorn on 127.0.0.1 in a thread; (port, server, thread)."""
    ready, port = threading.Event(), {}
    server = DrainingServer(
        build_app(FakeEngine(), MODEL, guard),
        "127.0.0.1",
        0,
        grace_s=1.0,
        guard=guard,
        on_ready=lambda host, p: (port.update(p=p), ready.set()),
    )
    thread = threading.Thread(target=server.run, name="uvicorn-connections-test", daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    return port["p"], server, thread


@pytest.fixture
def served(request):
    port, server, thread = serve(request.param)
    yield port, server
    server.request_shutdown()
    thread.join(30)
    assert not thread.is_alive(), "the server did not stop"


def health(port: int) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=30, trust_env=False)


def closed_by_server(sock: socket.socket, trickle: bytes = b"", every_s: float = 0.25) -> tuple[bool, bytes]:
    """Wait up to DEADLINE_S for the server to close `sock`, sending the next byte of `trickle` every
    `every_s` meanwhile (a slow client); (closed, what the server sent)."""
    deadline, answer, sent = time.monotonic() + DEADLINE_S, b"", 0
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], every_s)
        try:
            if readable:
                data = sock.recv(65536)
                if not data:
                    return True, answer
                answer += data
            elif sent < len(trickle):
                sock.sendall(trickle[sent : sent + 1])
                sent += 1
        except (ConnectionResetError, BrokenPipeError):
            return True, answer
    return False, answer


def kept_connection(port: int) -> http.client.HTTPConnection:
    """An HTTP/1.1 connection that has had one request answered, and is kept open."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    response = conn.getresponse()
    response.read()
    assert response.status == 200 and not response.will_close
    return conn


def held_connection(port: int, head: bytes = SLOW_HEAD[:20]) -> socket.socket:
    """A connection that has sent part of a request head, and sends no more."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head)
    return sock


# -- the flags ----------------------------------------------------------------------------------------


def test_connection_flags_make_the_guard():
    parser = argparse.ArgumentParser()
    add_http_flags(parser)
    defaults = http_options_of(parser.parse_args([]), {})
    assert (defaults.max_connections, defaults.header_timeout_s, defaults.keep_alive_timeout_s) == (1024, 30.0, 5.0)
    args = parser.parse_args(["--max-connections", "64", "--header-timeout", "2.5", "--keep-alive-timeout", "0.5"])
    guard = http_options_of(args, {})
    assert (guard.max_connections, guard.header_timeout_s, guard.keep_alive_timeout_s) == (64, 2.5, 0.5)
    for flag in ("--max-connections", "--header-timeout", "--keep-alive-timeout"):
        help_text = next(a.help for a in parser._actions if flag in a.option_strings)
        assert "default" in help_text and len(help_text) > 60, (flag, help_text)
        for bad in ("0", "-3", "x", "nan", "inf", ""):
            with pytest.raises(SystemExit):
                parser.parse_args([flag, bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-connections", "2.5"])
    for bad in (
        {"max_connections": 0},
        {"header_timeout_s": 0.0},
        {"header_timeout_s": math.inf},
        {"keep_alive_timeout_s": math.nan},
        {"keep_alive_timeout_s": -1.0},
    ):
        with pytest.raises(ValueError):
            HttpGuard(**bad)


# -- the header deadline ------------------------------------------------------------------------------


@pytest.mark.parametrize("served", [HttpGuard(header_timeout_s=1.5)], indirect=True)
def test_slow_request_heads_are_closed_and_normal_requests_answered(served):
    served, _ = served
    silent = socket.create_connection(("127.0.0.1", served), timeout=30)  # sends nothing at all
    one_byte = [held_connection(served, b"G") for _ in range(20)]
    trickling = held_connection(served, SLOW_HEAD[:1])
    try:
        assert health(served).status_code == 200  # while the slow ones are open
        closed, answer = closed_by_server(trickling, SLOW_HEAD[1:])  # a byte every 0.25 s: never done in time
        assert closed and answer == b"", answer
        for sock in [silent, *one_byte]:
            assert closed_by_server(sock) == (True, b"")
        assert health(served).status_code == 200
    finally:
        for sock in [silent, *one_byte, trickling]:
            sock.close()


@pytest.mark.parametrize("served", [HttpGuard(header_timeout_s=1.5, keep_alive_timeout_s=60.0)], indirect=True)
def test_the_deadline_runs_again_for_the_next_request_on_a_kept_connection(served):
    conn = kept_connection(served[0])
    try:
        # the first byte of the next head cancels uvicorn's keep-alive timer: only the deadline is left
        assert closed_by_server(conn.sock, SLOW_HEAD) == (True, b"")
    finally:
        conn.close()


@pytest.mark.parametrize("served", [HttpGuard(keep_alive_timeout_s=1.0)], indirect=True)
def test_idle_keep_alive_connections_close(served):
    conn = kept_connection(served[0])
    try:
        assert closed_by_server(conn.sock) == (True, b"")
    finally:
        conn.close()


# -- the connection cap ---------------------------------------------------------------------------------


@pytest.mark.parametrize("served", [HttpGuard(max_connections=3, header_timeout_s=120.0)], indirect=True)
def test_connections_past_the_cap_get_503_at_once(served):
    served, server = served

    def open_now(count: int):
        return wait_until(
            lambda: len(server.server_state.connections) == count, DEADLINE_S, f"{count} connections open at the server"
        )

    held = [held_connection(served) for _ in range(2)]
    try:
        assert health(served).status_code == 200  # the third of three: admitted and answered
        open_now(2)
        held.append(held_connection(served))
        open_now(3)
        with socket.create_connection(("127.0.0.1", served), timeout=30) as extra:
            closed, answer = closed_by_server(extra)  # refused before it sends a byte
        assert closed and answer.startswith(b"HTTP/1.1 503"), answer
        refused = health(served)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "too_many_connections"
        assert refused.headers["connection"] == "close"
        held.pop().close()
        wait_until(lambda: health(served).status_code == 200, DEADLINE_S, "a request once a connection closed")
    finally:
        for sock in held:
            sock.close()

"""The front end's hub survives any one connection: garbage, silence, a reset, a wrong key, a
2^30 length prefix, more connections than it checks at once; an honest driver joins afterwards,
or while they are still there, waiting its turn (floods: tests/integration/test_hub_flood.py)."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading
import time
from multiprocessing.connection import Client

import psutil
import pytest

from dist_infer.comm.rate_limited_log import RateLimitedLog
from dist_infer.serving.fleet.hub import Hub, StartupWaiter
from dist_infer.serving.fleet.hub_admission import AdmissionLimits
from dist_infer.serving.fleet.wire import Hello, StepOutputs
from dist_infer.serving.instance.join import dial_hub
from tests.support.polling import wait_until

KEY = b"k" * 32


def _hello(index: int) -> Hello:
    return Hello.from_fields(index=index, tp=1, pp=1, total_blocks=8, block_size=4, max_positions=64, vocab_size=10)


def _join(address, index: int, key: bytes = KEY):
    conn = Client(address, authkey=key)
    conn.send(_hello(index))
    return conn


@pytest.fixture
def hub():
    h = Hub("127.0.0.1", KEY, handshake_timeout_s=1.0, max_handshakes=4)
    joined: list = []
    got = threading.Event()

    def on_hello(conn, hello):
        joined.append((conn, hello))
        got.set()

    h.start(on_hello)
    h.joined, h.got = joined, got
    yield h
    h.close()


def test_hostile_connections_leave_the_hub_accepting(hub):
    rss = psutil.Process().memory_info().rss
    socks = []
    garbage = socket.create_connection(hub.address)
    garbage.sendall(b"\x00\xff" * 1000)
    socks.append(garbage)
    huge = socket.create_connection(hub.address)
    huge.sendall(struct.pack("!i", 2**30))  # a length prefix of 1 GiB, then silence
    socks.append(huge)
    reset = socket.create_connection(hub.address)
    reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reset.close()  # RST, not FIN
    silent = [socket.create_connection(hub.address) for _ in range(6)]  # more than the 4 checked at once
    socks += silent
    with pytest.raises(Exception):
        Client(hub.address, authkey=b"wrong" * 4)
    # handshakes time out after 1 s each; the accept loop never stopped
    wait_until(lambda: hub.refused >= 4, 10.0, "4 connections refused")
    for s in socks:
        s.close()
    conn = _join(hub.address, 0)
    assert hub.got.wait(10), "an honest driver could not join after the hostile connections"
    assert hub.joined[0][1].index == 0
    assert psutil.Process().memory_info().rss - rss < 200 * 2**20  # the 1 GiB prefix allocated nothing
    conn.close()


def test_a_driver_that_says_something_else_first_is_refused(hub):
    conn = Client(hub.address, authkey=KEY)
    conn.send(StepOutputs([]))
    wait_until(lambda: hub.refused >= 1, 10.0, "a connection refused")
    conn.close()
    second = _join(hub.address, 1)
    assert hub.got.wait(10) and hub.joined[0][1].index == 1
    second.close()


def test_a_hello_with_wrong_fields_is_refused(hub):
    with pytest.raises(ValueError, match="tp"):
        Hello.from_fields(index=0, tp=0, pp=1, total_blocks=8, block_size=4, max_positions=64, vocab_size=10)
    with pytest.raises(ValueError, match="without all its fields"):
        Hello.from_fields(index=0, tp=1)
    with pytest.raises(ValueError, match="unknown fields"):
        Hello.from_fields(index=0, tp=1, pp=1, total_blocks=8, block_size=4, max_positions=64, vocab_size=10, x=1)
    bad = dataclasses.replace(_hello(0), index="zero")  # what a pickle can carry: no constructor checks it
    conn = Client(hub.address, authkey=KEY)
    conn.send(bad)
    wait_until(lambda: hub.refused >= 1, 10.0, "a connection refused")
    conn.close()
    assert not hub.joined


def test_startup_waits_for_every_instance_and_names_the_missing():
    h = Hub("127.0.0.1", KEY, handshake_timeout_s=1.0)
    waiter = StartupWaiter(2)
    h.start(waiter.on_hello)
    try:
        first = _join(h.address, 1)
        wait_until(lambda: 1 in waiter.conns, 10.0, "instance 1's hello handled")  # (a busy machine is slow to)
        with pytest.raises(TimeoutError, match=r"instances \[0\]"):
            waiter.wait(1.0)
        zero = _join(h.address, 0)
        joined = waiter.wait(10.0)
        assert [hello.index for _, hello in joined] == [0, 1]
        later = []
        waiter.hand_over(lambda conn, hello: later.append(hello.index))
        more = _join(h.address, 2)
        wait_until(lambda: later == [2], 10.0, "the late join of instance 2 handed over")
        with pytest.raises(RuntimeError, match="exited"):
            StartupWaiter(1).wait(5.0, failed=lambda: "instance 0's job exited with code 1")
        for c in (first, zero, more):
            c.close()
    finally:
        h.close()


def test_a_slow_drip_handshake_is_cut_at_the_deadline(hub):
    """One byte at a time, each read well within the per-read timeout: the whole handshake's
    deadline still ends it, so drippers cannot hold the handshake slots."""
    drippers = [socket.create_connection(hub.address) for _ in range(4)]  # every slot of this hub
    for s in drippers:
        s.sendall(b"\x00\x00\x00\xff")  # the answer to the challenge will be 255 bytes... one at a time
    start = time.monotonic()
    closed = set()
    while len(closed) < len(drippers) and time.monotonic() - start < 10:
        for i, s in enumerate(drippers):
            if i in closed:
                continue
            try:
                s.sendall(b"a")
            except OSError:
                closed.add(i)
        time.sleep(0.2)
    assert len(closed) == len(drippers), "a dripping connection outlived the handshake deadline"
    conn = _join(hub.address, 3)
    assert hub.got.wait(10) and hub.joined[0][1].index == 3
    conn.close()
    for s in drippers:
        s.close()


def test_connections_past_the_per_source_cap_wait_their_turn():
    """Four silent strangers hold every slot 127.0.0.1 gets; a driver from the same address is not
    closed at accept (as before) but waits, and starts once a stranger's deadline frees a slot.
    A waiting stranger that speaks before the challenge is dropped without a handshake."""
    lines: list[str] = []
    h = Hub(
        "127.0.0.1",
        KEY,
        handshake_timeout_s=1.0,
        limits=AdmissionLimits(per_source=4),
        log=RateLimitedLog(emit=lines.append),
    )
    joined = []
    h.start(lambda conn, hello: joined.append(hello.index))
    silent = [socket.create_connection(h.address) for _ in range(4)]
    try:
        wait_until(lambda: h._admission.running == 4, 10.0, "4 handshakes running")
        eager = socket.create_connection(h.address)
        eager.sendall(b"\x00\x00\x00\x05hello")  # a client of multiprocessing waits for the challenge
        wait_until(
            lambda: any("spoke first" in line for line in lines), 10.0, lambda: f"the eager one dropped: {lines}"
        )
        conn = dial_hub(h.address, KEY, 10.0)  # waits for a slot, then the key challenge
        conn.send(_hello(5))
        wait_until(lambda: joined == [5], 10.0, "the driver joined")
        assert h.refused >= 5  # the four silent ones timed out, and the eager one
        conn.close()
        eager.close()
    finally:
        for s in silent:
            s.close()
        h.close()

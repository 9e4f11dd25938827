"""`serve --join HOST:PORT`: the hub's address read with a clear error for anything else; a
driver's join retried with growing, jittered pauses for up to a minute, each try bounded."""

from __future__ import annotations

import random
import socket
import time
from multiprocessing import AuthenticationError

import pytest

from dist_infer.serving.fleet.hub import Hub
from dist_infer.serving.fleet.wire import Hello
from dist_infer.serving.instance.join import JoinRetry, dial_hub, hub_to_join, join_hub, retry_pause
from dist_infer.serving.placement.spawn import HUB_KEY_ENV
from tests.support.polling import wait_until


def test_join_addresses(monkeypatch):
    monkeypatch.setenv(HUB_KEY_ENV, "k")
    assert hub_to_join("10.0.0.1:4242", None) == (("10.0.0.1", 4242), b"k")
    assert hub_to_join("[::1]:4242", None) == (("::1", 4242), b"k")
    for bad in ("h:99999", "h:0", "h:²", "h:", ":80", "h", ""):
        with pytest.raises(ValueError, match="HOST:PORT"):
            hub_to_join(bad, None)


class FakeTime:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_retry_pauses_grow_with_jitter_up_to_the_cap():
    retry, rng = JoinRetry(first_s=0.1, max_s=5.0), random.Random(0)
    for tries in range(1, 12):
        cap = min(5.0, 0.1 * 2 ** (tries - 1))
        pauses = [retry_pause(tries, retry, rng) for _ in range(50)]
        assert all(cap / 2 <= p <= cap for p in pauses)
        assert len(set(pauses)) > 1  # jittered: drivers restarted together do not retry in step


def test_join_retries_until_the_hub_takes_it():
    t = FakeTime()
    failures = [ConnectionRefusedError("refused"), EOFError(), ConnectionResetError("reset")]

    def dial(address, key, timeout):
        t.now += 0.01
        if failures:
            raise failures.pop(0)
        return "conn"

    assert join_hub(("127.0.0.1", 1), b"k", 0, dial=dial, clock=t.clock, sleep=t.sleep) == "conn"
    assert len(t.sleeps) == 3 and t.sleeps[0] <= 0.1 < t.sleeps[2] <= 0.4


def test_join_gives_up_after_its_budget_saying_how_long_and_why():
    t = FakeTime()
    tries = []

    def dial(address, key, timeout):
        tries.append(timeout)
        t.now += 0.5
        raise ConnectionResetError("connection reset by peer")

    with pytest.raises(
        ConnectionError,
        match=r"instance 3: could not join the API's hub at 10.0.0.1:7 in (5[0-9]|60)\.\d s "
        r"\(\d+ tries, up to 60 s\); the last failed with ConnectionResetError: "
        r"connection reset by peer",
    ):
        join_hub(("10.0.0.1", 7), b"k", 3, dial=dial, clock=t.clock, sleep=t.sleep, rng=random.Random(7))
    # no pause starts past the budget; the last try itself may end up to its own length (0.5 s) after
    assert 15 <= len(tries) <= 30 and t.now <= 60 + 0.5
    assert max(tries) <= JoinRetry().attempt_s


def test_a_hub_without_our_key_is_not_retried():
    t = FakeTime()

    def dial(address, key, timeout):
        raise AuthenticationError("digest sent was rejected")

    with pytest.raises(AuthenticationError):
        join_hub(("127.0.0.1", 1), b"k", 0, dial=dial, clock=t.clock, sleep=t.sleep)
    assert not t.sleeps


def test_dial_hub_joins_a_real_hub_and_bounds_a_silent_one():
    hub = Hub("127.0.0.1", b"key", handshake_timeout_s=2.0)
    got = []
    hub.start(lambda conn, hello: got.append(hello.index))
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does) and never speaks
    try:
        conn = dial_hub(hub.address, b"key", 5.0)
        conn.send(Hello.from_fields(index=7, tp=1, pp=1, total_blocks=8, block_size=4, max_positions=64, vocab_size=10))
        wait_until(lambda: got == [7], 10.0, "the hello handed over")
        conn.close()
        with pytest.raises(AuthenticationError):
            dial_hub(hub.address, b"wrong", 5.0)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="within 0.5 s"):
            dial_hub(silent.getsockname(), b"key", 0.5)
        assert time.monotonic() - start < 5.0
    finally:
        silent.close()
        hub.close()

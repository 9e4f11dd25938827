"""The rate-limited log: a flood of events writes a line a second per key, with the count held back."""

from __future__ import annotations

from dist_infer.comm.rate_limited_log import RateLimitedLog

SUMMARY = "hub: refused {count} connections from 127.0.0.1 in the last {seconds:.1f} s (bad handshake)"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _log(**kw):
    clock, lines = Clock(), []
    return RateLimitedLog(clock=clock, emit=lines.append, **kw), clock, lines


def test_a_flood_writes_one_line_a_second_with_the_count():
    log, clock, lines = _log()
    for i in range(10_000):  # 10,000 events over 5 s
        clock.now = 100.0 + i * 5.0 / 10_000
        log("k", f"refused connection {i}", SUMMARY)
    assert lines[0] == "refused connection 0"  # the first of a quiet spell, in full
    assert len(lines) == 5  # then one summary a second
    assert lines[1] == SUMMARY.format(count=1999, seconds=1.0)
    clock.now += 1.0
    log.flush()  # the flood stopped: its last count still goes out
    counts = [int(line.split("refused ")[1].split(" ")[0]) for line in lines[1:]]
    assert sum(counts) == 9_999 and len(lines) == 6


def test_keys_are_limited_apart_and_a_quiet_key_starts_afresh():
    log, clock, lines = _log()
    log(("bad", "10.0.0.1"), "a1", "a {count}")
    log(("bad", "10.0.0.2"), "b1", "b {count}")
    log(("bad", "10.0.0.1"), "a2", "a {count}")
    assert lines == ["a1", "b1"]
    clock.now += 1.5
    log.flush()
    assert lines == ["a1", "b1", "a 1"]  # b had nothing held back: no summary
    clock.now += 5
    log(("bad", "10.0.0.1"), "a3", "a {count}")  # quiet for a while: in full again
    assert lines[-1] == "a3"


def test_flush_writes_each_interval_once_and_keeps_counting():
    log, clock, lines = _log(interval=1.0)
    log("k", "first", "{count} more")
    log("k", "second", "{count} more")
    clock.now += 0.5
    log.flush()
    assert lines == ["first"]  # the interval is not over
    clock.now += 0.5
    log.flush()
    assert lines == ["first", "1 more"]
    log("k", "third", "{count} more")  # within the interval the summary opened: counted, not written
    log.flush()
    assert lines == ["first", "1 more"]
    clock.now += 1.0
    log.flush()
    log.flush()
    assert lines == ["first", "1 more", "1 more"]
    clock.now += 1.0
    log.flush()  # a quiet interval: the key is forgotten, its next event written in full
    log("k", "fourth", "{count} more")
    assert lines[-1] == "fourth"


def test_too_many_sources_share_one_overflow_count():
    log, clock, lines = _log(max_keys=4)
    for i in range(100):
        log(("bad", f"10.0.0.{i}"), f"from {i}", "{count}")
    assert lines == [f"from {i}" for i in range(4)]  # the table is full: the rest are only counted
    clock.now += 1.0
    log.flush()
    assert lines[-1].startswith("96 more events from other sources")
    log(("bad", "10.0.0.99"), "from 99", "{count}")  # the quiet keys were forgotten: room again
    assert lines[-1] == "from 99"

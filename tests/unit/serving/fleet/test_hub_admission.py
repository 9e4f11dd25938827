"""The hub's admission per source: caps, back-off of a failing source, and a real join from the
same address as a flood still getting its turn."""

from __future__ import annotations

import pytest

from dist_infer.serving.fleet.hub_admission import AdmissionLimits, SourceAdmission, Verdict

LOCAL = "127.0.0.1"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _admission(**kw) -> tuple[SourceAdmission, Clock]:
    clock = Clock()
    return SourceAdmission(AdmissionLimits(**kw), clock=clock), clock


def test_per_source_and_global_caps_park_the_rest():
    a, _ = _admission(max_handshakes=6, per_source=4)
    assert [a.arrive(LOCAL) for _ in range(5)] == [Verdict.START] * 4 + [Verdict.WAIT]
    assert [a.arrive("10.0.0.2") for _ in range(3)] == [Verdict.START] * 2 + [Verdict.WAIT]  # 6 in all
    assert a.running == 6 and a.waiting == 2
    assert not a.may_start(LOCAL) and not a.may_start("10.0.0.2")
    a.failed(LOCAL)
    assert a.may_start(LOCAL)  # the freed slot goes to a waiting connection
    assert not a.may_start("10.0.0.2")  # and the global cap holds the other
    assert a.running == 6 and a.waiting == 1


def test_a_later_arrival_does_not_jump_the_line():
    a, _ = _admission(per_source=1)
    assert a.arrive(LOCAL) is Verdict.START
    assert a.arrive(LOCAL) is Verdict.WAIT
    a.authenticated(LOCAL)  # a slot is free, but one is waiting for it
    assert a.arrive(LOCAL) is Verdict.WAIT
    assert a.may_start(LOCAL) and a.waiting == 1


def test_the_waiting_room_is_capped_at_accept():
    a, _ = _admission(max_handshakes=1, max_waiting=10, max_waiting_per_source=3)
    verdicts = [a.arrive(LOCAL) for _ in range(5)]
    assert verdicts == [Verdict.START] + [Verdict.WAIT] * 3 + [Verdict.REFUSE]
    others = [a.arrive(f"10.0.0.{i}") for i in range(12)]
    assert others == [Verdict.WAIT] * 7 + [Verdict.REFUSE] * 5  # 10 waiting in all
    assert a.waiting == 10


def test_a_failing_source_backs_off_for_a_growing_capped_interval():
    a, clock = _admission(per_source=100, fail_threshold=3, backoff_first_s=0.1, backoff_max_s=0.4)
    waits = []
    for _ in range(5):
        for _ in range(3):
            assert a.arrive(LOCAL) is Verdict.START
            a.failed(LOCAL)
        waits.append(a.backing_off(LOCAL))
        assert a.arrive(LOCAL) is Verdict.WAIT  # backing off: connections wait, they are not refused
        clock.now += waits[-1]
        assert a.may_start(LOCAL)
        a.authenticated(LOCAL)  # a success ends the streak, not the intervals' growth
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.4, 0.4])  # doubling, capped
    clock.now += 31  # a source quiet past forget_s starts again from the first interval
    for _ in range(3):
        a.arrive(LOCAL)
        a.failed(LOCAL)
    assert a.backing_off(LOCAL) == pytest.approx(0.1)


def test_a_success_ends_the_failure_streak():
    a, _ = _admission(per_source=100, fail_threshold=3)
    for ok in (False, False, True, False, False):
        a.arrive(LOCAL)
        a.authenticated(LOCAL) if ok else a.failed(LOCAL)
    assert a.backing_off(LOCAL) == 0.0


def test_a_source_that_holds_nothing_is_forgotten():
    a, clock = _admission(max_sources=8)
    for i in range(100):  # many addresses, each failing once
        a.arrive(f"10.0.{i}.1")
        a.failed(f"10.0.{i}.1")
    assert a.sources() <= 8
    clock.now += 31
    a.arrive(LOCAL)
    a.authenticated(LOCAL)
    assert a.sources() <= 8


def test_failures_during_a_back_off_do_not_lengthen_it():
    a, clock = _admission(per_source=100, fail_threshold=2, backoff_first_s=0.5)
    for _ in range(2):
        a.arrive(LOCAL), a.failed(LOCAL)
    assert a.backing_off(LOCAL) == pytest.approx(0.5)
    for _ in range(50):  # connect-and-close while it waits: each parked one hangs up
        assert a.arrive(LOCAL) is Verdict.WAIT
        a.stop_waiting(LOCAL, failed=True)
    assert a.backing_off(LOCAL) == pytest.approx(0.5)
    assert a.next_backoff_end() is None  # nothing waits on it
    assert a.arrive(LOCAL) is Verdict.WAIT
    assert a.next_backoff_end() == pytest.approx(clock.now + 0.5)


def test_a_real_join_behind_a_flood_from_its_own_address_gets_its_turn():
    """20 strangers on 127.0.0.1 reconnect as fast as they can with a wrong key; a driver on
    127.0.0.1 arrives in the middle. Waiting connections start in arrival order, so the driver
    starts after at most the strangers' open connections, within a few back-off intervals,
    however fast they reconnect."""
    a, clock = _admission()
    line: list[str] = []  # the hub's parked connections, oldest first
    running: list[str] = []
    driver_started_at = None
    for step in range(100_000):
        clock.now += 0.0005
        if step == 2000:
            line.append("driver")
        open_strangers = line.count("stranger") + running.count("stranger")
        if open_strangers < 20:  # a stranger whose connection ended reconnects at once
            if a.arrive(LOCAL) is Verdict.START:
                running.append("stranger")
            else:
                line.append("stranger")
        while line and a.may_start(LOCAL):
            who = line.pop(0)
            if who == "driver":
                driver_started_at = clock.now
                break
            running.append(who)
        if driver_started_at is not None:
            break
        if running:  # a wrong key fails in a millisecond or so: one a step
            running.pop(0)
            a.failed(LOCAL)
    assert driver_started_at is not None, "the driver never got a handshake slot"
    waited = driver_started_at - (1000.0 + 2001 * 0.0005)
    assert waited < 5.0, f"the driver waited {waited:.1f} s behind the flood"


def test_limits_are_checked():
    with pytest.raises(ValueError, match="per_source"):
        AdmissionLimits(per_source=0)

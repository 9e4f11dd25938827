"""The SLO autoscaler's policy (serving/placement/autoscale_policy.py), pure: flags, the windowed p90s, when it
scales up and down, and the flap guard (cool-down and hysteresis); and its hands (autoscaler.py)
stopping at --max-ranks."""

from __future__ import annotations

import time

import pytest

from dist_infer.serving.placement.autoscale_policy import (
    SLO,
    AutoscaleError,
    AutoscalePolicy,
    FleetSample,
    LatencyWindow,
    p90,
    parse_autoscale,
    parse_slo,
)


def test_flags_parse_and_name_themselves():
    assert parse_slo("ttft=2,tpot=0.1") == SLO(2.0, 0.1) and parse_slo("tpot=0.05") == SLO(None, 0.05)
    assert parse_autoscale("1:3") == (1, 3) and parse_autoscale("2:2") == (2, 2)
    for bad in ("", "ttft", "ttft=0", "e2e=3", "ttft=x", "ttft=-1", "ttft=inf"):
        with pytest.raises(AutoscaleError, match="--slo"):
            parse_slo(bad)
    for bad in ("3", "3:1", "0:2", "a:b", "1:"):
        with pytest.raises(AutoscaleError, match="--autoscale"):
            parse_autoscale(bad)


def test_p90_and_the_window_forget_old_samples():
    assert p90([]) is None and p90([5.0]) == 5.0 and p90(list(range(1, 11))) == 9
    w = LatencyWindow(window_s=10.0)
    w.record(0.0, ttft=9.0)
    w.record(5.0, ttft=1.0, gap=0.3, tokens=3)
    assert w.p90s(6.0) == (9.0, pytest.approx(0.1))
    assert w.p90s(12.0) == (1.0, pytest.approx(0.1)), "the 9 s TTFT left the window"
    assert w.p90s(100.0) == (None, None)
    w.record(101.0, ttft=4.0)
    w.record(104.0, ttft=0.5)
    assert w.p90s(105.0) == (4.0, None) and w.p90s(105.0, span=2.0) == (0.5, None)


def _sample(
    now, serving=1, starting=0, ttft=None, tpot=None, wait=0.0, queued=0, running=0, recent=None, predicted=0.0
):
    """`recent`: the p90s of the last low_for_s seconds (default: the window's)."""
    recent = (ttft, tpot) if recent is None else recent
    return FleetSample(now, serving, starting, ttft, tpot, wait, queued, running, *recent, predicted_wait_s=predicted)


def test_up_on_a_missed_slo_or_a_long_wait_and_only_one_start_at_a_time():
    p = AutoscalePolicy(1, 3, SLO(ttft_s=2.0, tpot_s=0.1), cooldown_s=5.0)
    assert p.decide(_sample(0.0, ttft=1.0, tpot=0.05)) is None
    d = p.decide(_sample(1.0, ttft=2.5))
    assert d.action == "up" and "p90 TTFT" in d.reason and d.instances == 1
    assert p.decide(_sample(3.0, ttft=9.0)) is None, "cool-down"
    assert p.decide(_sample(7.0, serving=1, starting=1, ttft=9.0)) is None, "one instance starting already"
    d = p.decide(_sample(8.0, serving=2, wait=3.0, queued=4))
    assert d.action == "up" and "waited 3 s" in d.reason
    assert p.decide(_sample(20.0, serving=3, tpot=0.5)) is None, "at MAX"
    q = AutoscalePolicy(1, 3, SLO(tpot_s=0.1))
    assert q.decide(_sample(0.0, tpot=0.2)).action == "up"


def test_up_when_the_queued_prompts_predict_a_wait_past_the_slo_before_anyone_waited():
    p = AutoscalePolicy(1, 3, SLO(ttft_s=2.0), cooldown_s=5.0)
    assert p.decide(_sample(0.0, queued=3, wait=0.2, predicted=1.5)) is None, "within the SLO"
    d = p.decide(_sample(1.0, queued=6, wait=0.3, predicted=2.6))
    assert d.action == "up" and "predict a 2.6 s wait" in d.reason
    assert AutoscalePolicy(1, 3, SLO(tpot_s=0.1)).decide(_sample(0.0, predicted=50.0)) is None, "no TTFT SLO"


def test_down_only_after_a_sustained_low_and_never_below_min():
    p = AutoscalePolicy(1, 3, SLO(ttft_s=2.0, tpot_s=0.1), cooldown_s=5.0, low_water=0.5, low_for_s=10.0)
    assert p.decide(_sample(0.0, serving=2, ttft=0.5, tpot=0.02)) is None
    assert p.decide(_sample(5.0, serving=2, ttft=1.5, tpot=0.02)) is None, "between the thresholds: hysteresis"
    assert p.decide(_sample(6.0, serving=2, ttft=0.5)) is None, "the low spell starts again"
    assert p.decide(_sample(12.0, serving=2, ttft=0.5, queued=1)) is None, "something queued"
    assert p.decide(_sample(12.5, serving=2, ttft=0.5, running=3)) is None, "fast, but busy: the burst goes on"
    assert p.decide(_sample(13.0, serving=2)) is None
    d = p.decide(_sample(23.5, serving=2))
    assert d.action == "down" and "10 s" in d.reason
    assert p.decide(_sample(60.0, serving=1)) is None, "at MIN"
    q = AutoscalePolicy(1, 3, SLO(ttft_s=2.0), cooldown_s=0.0, low_for_s=2.0)
    assert q.decide(_sample(0.0, serving=2, ttft=3.0, recent=(0.2, None))) is not None, "up on the window's p90"
    r = AutoscalePolicy(1, 3, SLO(ttft_s=2.0), cooldown_s=0.0, low_for_s=2.0)
    assert r.decide(_sample(0.0, serving=3, ttft=1.5, recent=(0.2, None))) is None
    d = r.decide(_sample(2.5, serving=3, ttft=1.5, recent=(0.2, None)))
    assert d.action == "down", "the burst's slow TTFTs still in the window do not hold a scale-down back"
    assert p.decide(_sample(61.0, serving=0)).action == "up", "below MIN (an instance died)"


def test_an_up_looks_only_at_first_tokens_since_the_last_decision():
    """A burst's slow first tokens, met by one instance, stay in the window after a scale-down; they
    must not add the instance back (the flap the real-server test caught): the sampler hands the
    policy the p90s of the first tokens after its last decision, and the backlog where dispatch
    would send a new request (the least of the serving instances')."""
    from types import SimpleNamespace

    from dist_infer.serving.fleet.wire import InstanceState
    from dist_infer.serving.placement.autoscaler import Autoscaler

    def instance(backlog):
        return SimpleNamespace(
            state=InstanceState.SERVING, accepting=True, stats=SimpleNamespace(prefill_backlog_s=backlog)
        )

    window = LatencyWindow(window_s=10.0)
    cluster = SimpleNamespace(
        instances=[instance(0.4), instance(None)],
        latency=window,
        num_open=lambda: 1,
        first_token_waits=lambda now: [],
        ranks_free=lambda: None,
    )
    policy = AutoscalePolicy(1, 2, SLO(ttft_s=0.3), cooldown_s=1.5, low_for_s=1.5)
    scaler = Autoscaler(cluster, policy, "tp1")
    for t in (100.0, 100.5, 101.0):
        window.record(t, ttft=0.9)  # the burst, before the scale-down
    assert scaler.sample(102.0).ttft_p90 == 0.9, "no decision yet: the whole window"
    policy._last_action = 103.0  # the scale-down
    window.record(104.0, ttft=0.1)
    got = scaler.sample(105.0)
    assert got.ttft_p90 == 0.1 and got.predicted_wait_s == 0.0 and got.serving == 2
    assert policy.decide(got) is None, "the burst's first tokens do not bring the instance back"
    assert scaler.sample(115.0).ttft_p90 is None, "and once the window has passed, it is the window's again"


def test_no_up_while_the_next_instance_would_pass_max_ranks_and_no_cool_down_for_it():
    p = AutoscalePolicy(1, 4, SLO(ttft_s=2.0), cooldown_s=5.0)
    blocked = FleetSample(0.0, 2, 0, 3.0, None, 0.0, 0, can_grow=False)
    assert p.decide(blocked) is None and "p90 TTFT" in p.held_back
    assert p.decide(_sample(1.0, serving=2, ttft=3.0)).action == "up", "room again: up at once, no cool-down ran"
    assert p.held_back is None
    q = AutoscalePolicy(2, 4, SLO(ttft_s=2.0))
    assert q.decide(FleetSample(0.0, 1, 0, None, None, 0.0, 0, can_grow=False)) is None, "not even to reach MIN"
    assert "fewer than --autoscale's minimum" in q.held_back


def test_the_autoscaler_stops_at_max_ranks_and_says_so_once():
    """Over the SLO at every tick, with no rank free: it never calls add_instance, and logs and lists
    the held-back up once; once ranks free up it scales up again."""
    from types import SimpleNamespace

    from loguru import logger

    from dist_infer.serving.fleet.wire import InstanceState
    from dist_infer.serving.placement.autoscaler import Autoscaler

    added, free = [], {"ranks": 1}
    serving = SimpleNamespace(
        state=InstanceState.SERVING, accepting=True, spec=None, stats=SimpleNamespace(prefill_backlog_s=0.0)
    )
    cluster = SimpleNamespace(
        instances=[serving],
        latency=LatencyWindow(),
        num_open=lambda: 3,
        first_token_waits=lambda now: [9.0, 9.0, 9.0],  # waited past the 1 s SLO
        ranks_free=lambda: free["ranks"],
        add_instance=lambda layout: added.append(layout) or {"index": 1},
    )
    scaler = Autoscaler(cluster, AutoscalePolicy(1, 8, SLO(ttft_s=1.0), cooldown_s=0.0), "tp=2")
    lines = []
    logger.enable("dist_infer")  # the library is quiet unless enabled
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        assert [scaler.tick(100.0 + t) for t in range(5)] == [None] * 5, "one rank free; tp=2 needs two"
    finally:
        logger.remove(sink)
        logger.disable("dist_infer")
    assert added == [] and scaler.at_rank_bound and scaler.describe()["at_rank_bound"]
    assert len([x for x in lines if "autoscale up" in x]) == 1, lines
    assert "needs 2 ranks and 1 are free under --max-ranks" in lines[0]
    assert len(scaler.decisions) == 1 and scaler.counts == {"up_at_rank_bound": 1}
    free["ranks"] = 2
    decision = scaler.tick(200.0)
    assert decision is not None and decision.action == "up" and not scaler.at_rank_bound
    deadline = time.monotonic() + 10
    while not added:  # tick acts on a thread of its own
        assert time.monotonic() < deadline, scaler.decisions
        time.sleep(0.01)
    assert added == ["tp=2"]

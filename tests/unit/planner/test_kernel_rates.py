"""calibrate's timings on a fake clock: memory at its sustained rate (not the best pass), the
streaming rate pooled over two looks, the size factor the median round."""

from __future__ import annotations

import pytest

from dist_infer.planner import kernel_rates


def test_calibrate_times_memory_at_its_sustained_rate(monkeypatch):
    """The best pass overstates how fast memory streams (a VM streams faster for a second after an
    idle spell than after): a memory-bound timing is the median after a warm-up, on a fake clock here."""
    clock = [0.0]
    monkeypatch.setattr(kernel_rates.time, "perf_counter", lambda: clock[0])
    calls = []

    def fn():  # 1 ms a call for the first 50 calls (the burst), then 2 ms, with one 0.5 ms outlier
        calls.append(1)
        clock[0] += 1e-3 if len(calls) <= 50 else (0.5e-3 if len(calls) == 60 else 2e-3)

    t = kernel_rates._sustained_time(fn, min_s=0.02, warm_s=0.05)
    assert t == pytest.approx(2e-3)
    assert kernel_rates._best_time(lambda: None) >= 0.0


def test_calibrate_streaming_rate_pools_both_looks(monkeypatch):
    """A slow spell of this VM can last minutes: the streaming rate is the median over two looks
    minutes apart, not the last look's (here 3 allocations timed slow, then 3 at twice the speed)."""
    spell = {"t": 2.0}
    monkeypatch.setattr(kernel_rates, "_sustained_time", lambda fn, **kw: spell["t"])
    samples: dict = {}
    first, _ = kernel_rates.measure_bandwidth(1, 1, (512,), 3, samples)
    spell["t"] = 1.0
    second, _ = kernel_rates.measure_bandwidth(1, 1, (512,), 3, samples)
    rate = first[0][1]  # bytes / 2 s
    assert len(samples[512]) == 6
    assert second[0][1] == pytest.approx(1.5 * rate)  # the median of three at r and three at 2r
    alone, _ = kernel_rates.measure_bandwidth(1, 1, (512,), 3)
    assert alone[0][1] == pytest.approx(2 * rate)  # no pool: this look only


def test_calibrate_size_factor_is_the_median_round(monkeypatch):
    """Each round times every size and divides by its own largest; one round whose largest fell
    in a fast spell (0.25 instead of 0.5) does not set the factor."""
    times = iter([2.0, 1.0, 2.0, 0.5, 2.0, 1.0])  # (small, large) per round
    monkeypatch.setattr(kernel_rates, "_sustained_time", lambda fn, **kw: next(times))
    got = kernel_rates.measure_size_factor(1, 1, (0.25, 1), rounds=3)
    if not got:
        pytest.skip("no native kernels: no size factor")
    assert [round(f, 6) for _, f in got] == [0.5, 1.0]

"""Arrival times: gamma gaps (mean one over the rate, burstiness widening or narrowing them),
seeded offsets from zero (an infinite rate all at once), trace timestamps relative and scaled."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dist_infer.bench.serve.arrivals import arrival_offsets, gamma_gaps, trace_offsets
from dist_infer.bench.serve.flags import InputError


def test_gamma_gaps_mean_is_one_over_rate():
    rng = np.random.default_rng(0)
    for burstiness in (0.5, 1.0, 3.0):
        gaps = gamma_gaps(200_000, rate=8.0, burstiness=burstiness, rng=rng)
        assert gaps.shape == (200_000,)
        assert (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.02)


def test_burstiness_below_one_widens_and_above_one_narrows_the_gaps():
    rate = 4.0
    variances = {}
    for burstiness in (0.25, 1.0, 4.0):
        gaps = gamma_gaps(200_000, rate, burstiness, np.random.default_rng(1))
        variances[burstiness] = gaps.var()
        assert variances[burstiness] == pytest.approx(1 / (rate * rate * burstiness), rel=0.05)
    assert variances[0.25] > variances[1.0] > variances[4.0]


def test_arrivals_are_seeded_start_at_zero_and_infinite_rate_is_all_at_once():
    a = arrival_offsets(50, 10.0, 1.0, np.random.default_rng(7))
    b = arrival_offsets(50, 10.0, 1.0, np.random.default_rng(7))
    assert np.array_equal(a, b)
    assert a[0] == 0.0 and len(a) == 50 and (np.diff(a) >= 0).all()
    assert not np.array_equal(a, arrival_offsets(50, 10.0, 1.0, np.random.default_rng(8)))
    assert np.array_equal(arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))
    assert len(arrival_offsets(1, 3.0, 1.0, np.random.default_rng(0))) == 1
    with pytest.raises(InputError):
        gamma_gaps(3, 1.0, 0.0, np.random.default_rng(0))


def test_trace_offsets_are_relative_to_the_first_and_scaled():
    assert trace_offsets([100.0, 101.5, 103.0], 2.0).tolist() == [0.0, 3.0, 6.0]
    assert trace_offsets([5.0, 6.0], 0.5).tolist() == [0.0, 0.5]

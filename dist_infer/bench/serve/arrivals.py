"""When each request is sent: all at once, Poisson, gamma with a burstiness factor, or a trace's
own timestamps.

Pure functions of a seeded generator, so a run's schedule can be replayed and tested without a
server.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from dist_infer.bench.serve.flags import InputError


def gamma_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """n gaps (s) between arrivals: gamma with shape=burstiness and mean 1/rate (shape 1 = Poisson).

    Variance is 1/(rate^2 * burstiness), so burstiness < 1 clumps requests and > 1 evens them out
    while the mean rate stays the same. An infinite rate gives zero gaps (all at once).
    """
    if not rate > 0 or not burstiness > 0:
        raise InputError(f"rate ({rate}) and burstiness ({burstiness}) must be positive")
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s after the start) of n requests; the first goes at 0."""
    gaps = gamma_gaps(max(n - 1, 0), rate, burstiness, rng)
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


def trace_offsets(timestamps: Sequence[float], time_scale: float = 1.0) -> np.ndarray:
    """A trace's timestamps as send times relative to its first, gaps multiplied by time_scale."""
    stamps = np.asarray(timestamps, dtype=float)
    if stamps.size == 0:
        return stamps
    return (stamps - stamps.min()) * time_scale


def schedule(
    n: int,
    timestamps: Optional[Sequence[float]],
    request_rate: Optional[float],
    burstiness: float,
    time_scale: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, str]:
    """Send times of n requests and a phrase for the report saying how they arrive.

    A trace (timestamps given) keeps its own timing unless --request-rate overrides it; without a
    rate everything else is sent at once.
    """
    if timestamps is not None and request_rate is None:
        return trace_offsets(timestamps, time_scale), f"trace timestamps x {time_scale:g}"
    rate = request_rate if request_rate is not None else math.inf
    offsets = arrival_offsets(n, rate, burstiness, rng)
    arrivals = (
        "all at once"
        if math.isinf(rate)
        else f"{'Poisson' if burstiness == 1 else f'gamma (burstiness {burstiness:g})'} at {rate:g} req/s"
    )
    return offsets, arrivals

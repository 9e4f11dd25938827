"""Observations counted per histogram bucket: what the fleet keeps of migration downtimes and
failover recoveries, which /metrics exports as Prometheus histograms (serving/http/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BucketCounts:
    """Observations counted per bucket (Prometheus' upper bounds, then +Inf) with their sum: what
    the front end keeps for each histogram /metrics exports."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.total += value
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))] += 1

    def snapshot(self) -> tuple[tuple[float, ...], list[int], float]:
        return self.bounds, list(self.counts), self.total

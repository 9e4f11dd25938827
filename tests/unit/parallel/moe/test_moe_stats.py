"""Routing statistics: per-step and summed tokens per expert and per rank, imbalance, reset."""

from __future__ import annotations

import torch

from dist_infer.parallel.moe.placement import ExpertPlacement
from dist_infer.parallel.moe.stats import RoutingStats


def test_routing_stats():
    stats = RoutingStats(ExpertPlacement.contiguous(4, 2))
    stats.record(torch.tensor([3, 1, 0, 0]))
    stats.record(torch.tensor([1, 1, 1, 1]))
    assert stats.last == {"tokens_per_expert": [1.0, 1.0, 1.0, 1.0], "tokens_per_rank": [2.0, 2.0], "imbalance": 1.0}
    s = stats.summary()
    assert s["steps"] == 2 and s["tokens_per_expert"] == [4.0, 2.0, 1.0, 1.0] and s["tokens_per_rank"] == [6.0, 2.0]
    assert s["step_imbalance_max"] == 2.0 and s["step_imbalance_mean"] == 1.5 and s["imbalance"] == 1.5
    assert list(stats.history) == [[4.0, 0.0], [2.0, 2.0]]
    stats.reset()
    assert stats.steps == 0 and not stats.history

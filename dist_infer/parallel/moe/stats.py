"""Routing statistics of one MoE layer, accumulated step by step: tokens per expert and per rank,
load imbalance, time per phase of the layer (`PHASES`), and how often experts' weights were read
(an expert with any token in a step reads its weights once; split by steps with and without
prompt tokens, what layered prefill saves against chunked: engine/layered_prefill.py).

Separate from the layer so that what is measured, and how it is summarised for the routing
report, can be read and tested without running the all-to-all.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch

from dist_infer.parallel.moe.placement import ExpertPlacement, imbalance

PHASES = ("route", "dispatch", "experts", "combine", "gather")


class RoutingStats:
    """One MoE layer's routing, step by step: tokens per expert, per rank, imbalance; time per phase.

    Counts are (token, expert) pairs over the whole ep group, identical on every rank of it.
    """

    def __init__(self, placement: ExpertPlacement, history: int = 1024):
        self.placement = placement
        self.history: deque = deque(maxlen=history)  # per step: tokens per rank
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.expert_tokens = torch.zeros(self.placement.num_experts, dtype=torch.float64)
        self.imbalance_sum = 0.0
        self.imbalance_max = 0.0
        self.last: Optional[dict] = None
        self.time_s = {p: 0.0 for p in PHASES}
        self.expert_reads = {"prompt": 0, "decode": 0}  # (step, expert) pairs with tokens, by the step's kind
        self.history.clear()

    def record(self, expert_counts: torch.Tensor, prompt: bool = False) -> None:
        """One step's tokens per expert [E] (summed over the ep group); `prompt`: the step carries
        prompt tokens (else only decodes)."""
        counts = expert_counts.to(torch.float64)
        self.expert_reads["prompt" if prompt else "decode"] += int((counts > 0).sum())
        per_rank = self.placement.rank_loads(counts.tolist())
        ratio = imbalance(per_rank)
        self.steps += 1
        self.expert_tokens += counts
        self.imbalance_sum += ratio
        self.imbalance_max = max(self.imbalance_max, ratio)
        self.last = {"tokens_per_expert": counts.tolist(), "tokens_per_rank": per_rank, "imbalance": ratio}
        self.history.append(per_rank)

    @property
    def rank_tokens(self) -> list[float]:
        return self.placement.rank_loads(self.expert_tokens.tolist())

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "tokens_per_expert": self.expert_tokens.tolist(),
            "tokens_per_rank": self.rank_tokens,
            "imbalance": imbalance(self.rank_tokens),
            "step_imbalance_mean": self.imbalance_sum / self.steps if self.steps else 1.0,
            "step_imbalance_max": self.imbalance_max if self.steps else 1.0,
            "placement": list(self.placement.owner),
            "time_s": dict(self.time_s),
            "expert_reads": dict(self.expert_reads),
        }

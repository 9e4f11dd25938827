"""Where a new request goes: the global scheduler's dispatch policies (pure, unit tested).

`load` is Llumnix's freeness, the KV blocks an instance has left per request it holds once its
queue is in:

    (free - watermark - blocks the waiting queue needs - blocks of requests sent but not yet
     seen - blocks the running requests still grow by) / (running + waiting + sent-but-not-seen)

so queued demand counts before the instance admits it, and a burst dispatched between two
load reports does not all land on the instance that looked emptiest. Two things go beyond
Llumnix: every request's demand is counted at its full length (prompt + max_tokens, which the
request states), and the request goes where the freeness is highest *after* placing it. Without
the second, an instance holding one long request looks freer than one holding two short ones
and takes the next long one too (it preempted far more on a bursty stream: docs/benchmarks.md,
"Live migration between instances"). `rr` takes turns; `queue` picks the shortest queue (vLLM's data-parallel
load balancing by waiting, then running).

`prefix` (the default) adds the prefix caches (serving/fleet/prefix_index.py): where no instance holds
any block of the prompt it is `load`; otherwise the request goes where

    cost = PREFILL_WEIGHT x (prompt blocks - blocks held there)              (prefill work left)
         + (total - available) + (blocks at full length - blocks held there)  (blocks active after it)

is least. Both terms are in KV blocks, so they add without a scale: the first is the prefill a
held prefix saves (TTFT, and compute every other request on that instance waits behind), the
second the memory and decode work the instance carries once it takes the request (committed
demand included, as `load` counts it); a held block also needs no new block. This is the sum
NVIDIA Dynamo's KV router minimises (its overlap weight 1 by default); llm-d scores the same two
things (prefix match and load) with weights. Ties go to the freer instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DISPATCH_POLICIES = ("prefix", "load", "rr", "queue")
PREFILL_WEIGHT = 1.0


@dataclass
class InstanceLoad:
    index: int
    free_blocks: int
    total_blocks: int
    watermark_blocks: int = 0
    waiting_demand: int = 0  # blocks the waiting queue needs, at full length
    running: int = 0
    waiting: int = 0
    pending: int = 0  # dispatched, not yet seen by the instance
    pending_blocks: int = 0
    accepting: bool = True  # false while draining or dead
    running_blocks: tuple = ()  # blocks each running request holds (the controller's choice)
    growth_blocks: int = 0  # blocks the running requests still need to reach max_tokens
    cached_blocks: int = 0  # leading blocks of the request's prompt this instance holds in its prefix cache

    @property
    def available(self) -> int:
        return self.free_blocks - self.watermark_blocks - self.waiting_demand - self.pending_blocks - self.growth_blocks

    @property
    def num_requests(self) -> int:
        return self.running + self.waiting + self.pending

    @property
    def freeness(self) -> float:
        """Blocks left per request once the queue is in (negative: demand exceeds the cache)."""
        return self.available / max(1, self.num_requests)

    def freeness_after(self, blocks: int) -> float:
        """The freeness once one more request of `blocks` (at full length) is placed here."""
        return (self.available - blocks) / (self.num_requests + 1)


class Dispatcher:
    """Chooses an instance for each new request among those that accept and can ever hold it."""

    def __init__(self, policy: str):
        if policy not in DISPATCH_POLICIES:
            raise ValueError(f"dispatch policy {policy!r} is not one of {DISPATCH_POLICIES}")
        self.policy = policy
        self._turn = 0

    def prefix_cost(self, load: InstanceLoad, blocks_needed: int, prompt_blocks: int) -> float:
        """The `prefix` policy's cost of placing the request on this instance (module docstring)."""
        held = min(load.cached_blocks, prompt_blocks)
        active = load.total_blocks - load.available + max(0, blocks_needed - held)
        return PREFILL_WEIGHT * (prompt_blocks - held) + active

    def choose(self, loads: list[InstanceLoad], blocks_needed: int, prompt_blocks: int = 0) -> Optional[int]:
        """The chosen instance's index, or None if none accepts one of `blocks_needed` blocks.
        `prompt_blocks`: the prompt's full blocks an instance could hold (the `prefix` policy)."""
        eligible = [x for x in loads if x.accepting and x.total_blocks >= blocks_needed]
        if not eligible:
            return None
        if self.policy == "rr":
            indices = sorted(x.index for x in eligible)
            pick = next((i for i in indices if i >= self._turn), indices[0])
            self._turn = pick + 1
            return pick
        if self.policy == "queue":
            return min(eligible, key=lambda x: (x.waiting + x.pending, x.running, x.index)).index
        if self.policy == "prefix" and any(x.cached_blocks for x in eligible):
            return min(
                eligible,
                key=lambda x: (
                    self.prefix_cost(x, blocks_needed, prompt_blocks),
                    -x.freeness_after(blocks_needed),
                    x.index,
                ),
            ).index
        return max(eligible, key=lambda x: (x.freeness_after(blocks_needed), -x.index)).index

"""Where a new request goes: the global scheduler's dispatch policies (pure, unit tested).

`load` is Llumnix's: an instance's freeness is the KV blocks it has left once its queue is
admitted, per request it holds:

    (free - watermark - blocks the waiting queue needs - blocks of requests sent but not yet
     seen) / (running + waiting + sent-but-not-seen)

so queued demand counts before the instance admits it, and a burst dispatched between two
load reports does not all land on the instance that looked emptiest. `rr` takes turns; `queue`
picks the shortest queue (vLLM's data-parallel load balancing by waiting, then running).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DISPATCH_POLICIES = ("load", "rr", "queue")


@dataclass
class InstanceLoad:
    index: int
    free_blocks: int
    total_blocks: int
    watermark_blocks: int = 0
    waiting_demand: int = 0  # blocks the waiting queue needs to be admitted
    running: int = 0
    waiting: int = 0
    pending: int = 0  # dispatched, not yet seen by the instance
    pending_blocks: int = 0
    accepting: bool = True  # false while draining or dead
    running_blocks: tuple = ()  # blocks each running request holds (the controller's choice)

    @property
    def available(self) -> int:
        return self.free_blocks - self.watermark_blocks - self.waiting_demand - self.pending_blocks

    @property
    def num_requests(self) -> int:
        return self.running + self.waiting + self.pending

    @property
    def freeness(self) -> float:
        """Blocks left per request once the queue is in (negative: demand exceeds the cache)."""
        return self.available / max(1, self.num_requests)


class Dispatcher:
    """Chooses an instance for each new request among those that accept and can ever hold it."""

    def __init__(self, policy: str):
        if policy not in DISPATCH_POLICIES:
            raise ValueError(f"dispatch policy {policy!r} is not one of {DISPATCH_POLICIES}")
        self.policy = policy
        self._turn = 0

    def choose(self, loads: list[InstanceLoad], blocks_needed: int) -> Optional[int]:
        """The chosen instance's index, or None if none accepts one of `blocks_needed` blocks."""
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
        return max(eligible, key=lambda x: (x.freeness, -x.index)).index

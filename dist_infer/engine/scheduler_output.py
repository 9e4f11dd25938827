"""What the scheduler (engine/scheduler.py) hands the driver for one step: the chunks of requests
the step computes, and the requests preempted or freed since the last one (whose blocks and
state on the ranks go)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dist_infer.engine.request import Request


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # tokens of the request already in the cache
    num_tokens: int  # new tokens computed this step
    sample: bool  # the chunk reaches the request's last known token: sample the next one
    layers: Optional[tuple[int, int]] = None  # layered prefill: the group of layers [first, end) it runs; None: all
    work_tokens: Optional[int] = None  # what it counts against the token budget (None: num_tokens)
    # speculative decoding: tokens proposed after the request's last one, computed with it (in
    # num_tokens) and checked by the step's sampled positions; only a decode chunk has them
    draft: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    freed: list[Request] = field(default_factory=list)  # requests whose blocks were freed since the last step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

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

    def prompt_cap(self, prefill_cap, first_prompt: Optional[Request]) -> float:
        """Prompt tokens a step may add beside the decodes already in it (`prefill_cap`: the scheduler's
        PrefillCap, a number or a function of the decodes, their context, their proposals and where
        `first_prompt`, the prompt the cap goes to first, starts and how much of it is left)."""
        if not callable(prefill_cap):
            return prefill_cap
        decodes = [c for c in self.chunks if c.num_tokens == 1 or c.draft]
        context = sum(c.start + c.num_tokens for c in decodes)
        start, left = (
            (first_prompt.num_computed, first_prompt.num_tokens - first_prompt.num_computed) if first_prompt else (0, 0)
        )
        cap = prefill_cap(len(decodes), context, start, sum(len(c.draft) for c in decodes), left)
        return float("inf") if cap is None else cap

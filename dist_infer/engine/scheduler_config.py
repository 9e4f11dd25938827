"""The scheduler's limits and modes (engine/scheduler.py): one frozen value, checked when it is
made, so a bad combination fails before any request is scheduled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dist_infer.arg_types import DEFAULT_PROMPT_MAX_WAIT_S
from dist_infer.engine.layered_prefill import LayeredPrefill
from dist_infer.engine.prompt_order import check_policy


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_batched_tokens: Optional[int] = 2048  # None: no budget (offline, everything in one step if it fits)
    max_num_seqs: int = 256
    watermark: float = 0.01  # fraction of blocks kept free when admitting a new request
    chunked_prefill: bool = True  # False: a prompt is computed in one step, never cut
    whole_prompt_steps: bool = False  # context parallel: a step is all fresh prompts or all decodes
    static_batching: bool = False  # the baseline: admit a new batch only when the running one has finished
    prefix_caching: bool = False  # reuse cached full blocks of matching prefixes (the engine turns it on)
    # False (bf16 prompts: models/fused_decode.py): a block holding generated tokens is not cached, as another
    # request's prompt matching it would take keys computed in fp32 where its run alone computes bf16 ones
    cache_generated: bool = True
    layered: Optional[LayeredPrefill] = None  # prompts over the budget run layer group by layer group, not cut
    policy: str = "fcfs"  # which prompt takes the budget first (engine/prompt_order.py: fcfs, shortest-prompt)
    max_wait_s: float = DEFAULT_PROMPT_MAX_WAIT_S  # shortest-prompt: a prompt waiting this long goes in arrival order

    def __post_init__(self):
        check_policy(self.policy, self.max_wait_s)
        if self.layered is not None and (self.whole_prompt_steps or not self.chunked_prefill):
            raise ValueError(
                "layered prefill replaces chunked prefill: it needs chunked prefill on and no context parallel"
            )
        if self.prefix_caching and self.whole_prompt_steps:
            raise ValueError("prefix caching does not support context parallel (whole-prompt steps): turn it off")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be at least 1, got {self.max_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")

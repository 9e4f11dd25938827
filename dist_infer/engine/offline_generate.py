"""Offline generation: "submit everything, run the loop", and what it measures.

`generate` (the library API, `dist-infer generate`, the bench) is the same engine as serving,
with no token budget and a cache sized for the batch unless the engine was given one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from dist_infer.engine.block_demand import blocks_at_full_length
from dist_infer.engine.driver_step import StepDriver
from dist_infer.engine.intake import RequestRegistry
from dist_infer.engine.offline_outputs import GenerationOutput
from dist_infer.engine.request import Request
from dist_infer.engine.sampling import SamplingParams, batch_seed
from dist_infer.engine.scheduler import Scheduler


@dataclass
class Timing:
    ttft_s: float = 0.0
    prefill_tokens: int = 0
    sequences: int = 1
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttft_cpu_s: float = 0.0  # CPU time of this process (all its threads) for the prefill: load-independent cost
    steps: int = 0
    preemptions: int = 0
    token_gaps_s: list = field(default_factory=list)  # each sequence's time between successive tokens

    @classmethod
    def for_batch(cls, prompts: list[list[int]]) -> "Timing":
        return cls(prefill_tokens=sum(len(p) for p in prompts), sequences=len(prompts))

    def as_dict(self) -> dict:
        return {
            "ttft_s": self.ttft_s,
            "prefill_tok_s": self.prefill_tokens / self.ttft_s if self.ttft_s else 0.0,
            "decode_tok_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            # time per output token of one sequence, i.e. per decode step of the batch (the peers' definition)
            "tpot_s": self.decode_s * self.sequences / self.decode_tokens if self.decode_tokens else 0.0,
            # the median gap between a sequence's tokens (vLLM's median ITL): a typical decode step,
            # which one stalled step (a page fault, another process taking the core) does not move
            "tpot_median_s": statistics.median(self.token_gaps_s) if self.token_gaps_s else 0.0,
            "ttft_cpu_s": self.ttft_cpu_s,
            "steps": self.steps,
            "preemptions": self.preemptions,
        }


def blocks_for_batch(prompts: list[list[int]], max_new_tokens: int, block_size: int, cp: int) -> int:
    """KV blocks that hold every sequence of an offline batch at full length at once (the bound
    check_fits holds a request to, so a batch sized here always passes it)."""
    return max(1, sum(blocks_at_full_length(len(p), max_new_tokens, block_size, cp) for p in prompts))


class OfflineGenerator:
    """Driver: one batch of prompts from submission to its outputs, timed. `submit` queues a
    request (the engine's add_request, which checks it); `driver` steps until `registry` has
    nothing left; `scheduler` counts the preemptions."""

    def __init__(
        self,
        driver: StepDriver,
        registry: RequestRegistry,
        scheduler: Scheduler,
        submit: Callable[[str, list[int], SamplingParams], Request],
    ):
        self.driver, self.registry, self.scheduler, self.submit = driver, registry, scheduler, submit

    def run(
        self, prompts: list[list[int]], params: SamplingParams, return_logits: bool
    ) -> tuple[list[GenerationOutput], Timing]:
        """Submit every prompt (each its own seed from the batch's), step until all finish, stop
        the followers. Returns the outputs in prompt order and the batch's timing."""
        timing = Timing.for_batch(prompts)
        self.driver.return_logits = return_logits
        preempted_before, steps_before = self.scheduler.num_preemptions, self.driver.completed_steps
        step = self.driver.next_step
        requests = [
            self.submit(f"offline-{step}-{i}", p, replace(params, seed=batch_seed(params.seed, i)))
            for i, p in enumerate(prompts)
        ]
        start, cpu_start = time.perf_counter(), time.process_time()
        first_done = None
        seen = [(0, 0.0)] * len(requests)  # each request's token count and the time its newest arrived
        while self.registry.has_unfinished():
            self.driver.step()
            now = time.perf_counter()
            for i, r in enumerate(requests):
                count, since = seen[i]
                if len(r.output_token_ids) > count:
                    if count:
                        timing.token_gaps_s.append((now - since) / (len(r.output_token_ids) - count))
                    seen[i] = (len(r.output_token_ids), now)
            if first_done is None and all(r.output_token_ids or r.finished for r in requests):
                first_done = time.perf_counter()
                timing.ttft_s = first_done - start
                timing.ttft_cpu_s = time.process_time() - cpu_start
        end = time.perf_counter()
        self.driver.stop_followers()
        self.driver.return_logits = False
        timing.steps = self.driver.completed_steps - steps_before
        timing.decode_tokens = sum(max(0, len(r.output_token_ids) - 1) for r in requests)
        timing.decode_s = end - (first_done or end)
        timing.preemptions = self.scheduler.num_preemptions - preempted_before
        outputs = [
            GenerationOutput(
                r.prompt_token_ids, r.output_token_ids, r.output_logprobs, r.finish_reason, r.logits, r.num_preemptions
            )
            for r in requests
        ]
        return outputs, timing

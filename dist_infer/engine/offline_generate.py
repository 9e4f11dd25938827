"""Offline generation: "submit everything, run the loop", and what it measures.

`generate` (the library API, `dist-infer generate`, the bench) is the same engine as serving,
with no token budget and a cache sized for the batch unless the engine was given one.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

from dist_infer.engine.offline_outputs import GenerationOutput, share_outputs
from dist_infer.engine.request import PromptError, check_prompt
from dist_infer.engine.sampling import SamplingParams, batch_seed
from dist_infer.engine.scheduler import blocks_at_full_length


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



class OfflineGenerate:
    """Engine mixin, collective: one batch of prompts from submission to every rank's outputs."""

    def blocks_for_batch(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """KV blocks that hold every sequence of an offline batch at full length at once (the bound
        check_fits holds a request to, so a batch sized here always passes it)."""
        return max(1, sum(blocks_at_full_length(len(p), max_new_tokens, self.block_size, self.cp.size) for p in prompts))

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams(),
                 return_logits: bool = False) -> list[GenerationOutput]:
        """Collective: every rank calls it with the same prompts; every rank gets the outputs."""
        prompts = [list(p) for p in prompts]
        if not prompts:
            raise PromptError("no prompts given")
        for i, p in enumerate(prompts):
            if self.fixed_blocks is None:  # the cache is sized for this batch below: only the model's limits apply
                check_prompt(p, params, self.cfg.vocab_size, self.cfg.max_positions, f"prompt {i}")
            else:
                self.check_request(p, params, name=f"prompt {i}")
        if self.fixed_blocks is None:
            need = self.blocks_for_batch(prompts, params.max_new_tokens)
            if self.scheduler is None or self.num_blocks < need:
                self.worker = self.scheduler = None  # the old cache goes before the new one is made
                self._allocate(need, max_rows=len(prompts))
        self.timing = Timing(prefill_tokens=sum(len(p) for p in prompts), sequences=len(prompts))
        if not self.is_driver:
            # its own prefill time, wall and CPU: up to its first sampled step (a profile splits at it)
            self._follower_start = (time.perf_counter(), time.process_time())
            self.follow()
            return share_outputs(self.groups.world, self.cfg.vocab_size, None, prompts, return_logits)
        self.return_logits = return_logits
        preempted_before = self.scheduler.num_preemptions
        requests = [self.add_request(f"offline-{self._step}-{i}", p, replace(params, seed=batch_seed(params.seed, i)))
                    for i, p in enumerate(prompts)]
        start, cpu_start = time.perf_counter(), time.process_time()
        first_done = None
        seen = [(0, 0.0)] * len(requests)  # each request's token count and the time its newest arrived
        while self.has_unfinished():
            self.step()
            now = time.perf_counter()
            for i, r in enumerate(requests):
                count, since = seen[i]
                if len(r.output_token_ids) > count:
                    if count:
                        self.timing.token_gaps_s.append((now - since) / (len(r.output_token_ids) - count))
                    seen[i] = (len(r.output_token_ids), now)
            if first_done is None and all(r.output_token_ids or r.finished for r in requests):
                first_done = time.perf_counter()
                self.timing.ttft_s = first_done - start
                self.timing.ttft_cpu_s = time.process_time() - cpu_start
        end = time.perf_counter()
        self.stop_followers()
        self.return_logits = False
        self.timing.decode_tokens = sum(max(0, len(r.output_token_ids) - 1) for r in requests)
        self.timing.decode_s = end - (first_done or end)
        self.timing.preemptions = self.scheduler.num_preemptions - preempted_before
        outputs = [GenerationOutput(r.prompt_token_ids, r.output_token_ids, r.output_logprobs,
                                    r.finish_reason, r.logits, r.num_preemptions) for r in requests]
        return share_outputs(self.groups.world, self.cfg.vocab_size, outputs, prompts, return_logits)

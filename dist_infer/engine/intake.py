"""Intake: the driver's requests, and the command queue that hands them to the step loop.

Other threads (the serving layer's) never touch the scheduler: they queue commands (add, abort,
call), which the step loop applies before its next step. The request registry (`_requests`, by id)
is what the loop steps, what migration finds and adopts, and what `stats` reports.
"""

from __future__ import annotations

import queue
import secrets
import time
from typing import Callable, Optional

from dist_infer.engine.request import PromptError, Request, RequestOutput, check_prompt
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.step_cost import prefill_backlog_s


class RequestIntake:
    """Engine mixin: adding, resuming, aborting requests (thread-safe), the registry, the stats.
    Uses the engine's scheduler, cfg, `_commands`, `_wakeup`, `_requests`, `_next_seq`."""

    # -- the registry (driver; the step loop's thread) --------------------------------------------
    def find(self, request_id: str) -> Optional[Request]:
        """Driver: the live request with this id, or None."""
        return self._requests.get(request_id)

    def hand_over(self, request: Request) -> None:
        """Driver: a paused request now lives on another instance: free its blocks, forget it here
        (no output: its client streams on from there)."""
        self.scheduler.hand_over(request)
        self._requests.pop(request.request_id, None)

    def adopt(self, request: Request, blocks: list[int]) -> None:
        """Driver: a request that migrated here, its computed tokens' KV in `blocks`."""
        request.seq_id = self._next_seq
        self._next_seq += 1
        self._requests[request.request_id] = request
        self.scheduler.install(request, blocks)

    # -- requests (driver; callable from other threads) -------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, name: str = "prompt") -> None:
        """Raise RequestError naming the field if the engine can never serve this request."""
        check_prompt(prompt_token_ids, params, self.cfg.vocab_size, self.cfg.max_positions, name)
        if self.scheduler is not None:
            why = self.scheduler.check_fits(len(prompt_token_ids), params.max_new_tokens)
            if why:
                raise PromptError(f"{name}: {why}", field="max_tokens")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request (thread-safe); it joins the batch at the next step."""
        return self._enqueue(self._new_request(request_id, prompt_token_ids, params))

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        self.check_request(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else secrets.randbits(52)
        return Request(request_id, list(prompt_token_ids), params, seed)

    def _enqueue(self, request: Request) -> Request:
        self._commands.put(("add", request))
        self._wakeup.set()
        return request

    def resume_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       progress) -> Request:
        """Queue a request whose instance died (thread-safe): it goes on from the tokens its client
        already has, prefilled again with them, and reports only what is new. `progress` is a
        serving/wire.ResumeProgress (token_ids, logprobs, top_logprobs reported so far;
        age_s, first_token_age_s). With the same seed (sampling draws from (seed, position)) it
        continues exactly as it would have."""
        r = self._new_request(request_id, prompt_token_ids, params)
        tokens = list(progress.token_ids)
        r.output_token_ids, r.output_logprobs = tokens, list(progress.logprobs)
        r.output_top_logprobs = [[tuple(x) for x in row] for row in progress.top_logprobs]
        r.emitted_tokens = len(tokens)
        now = time.monotonic()
        r.arrival_time = now - progress.age_s
        if tokens and progress.first_token_age_s is not None:
            r.first_token_time = now - progress.first_token_age_s
        return self._enqueue(r)

    def abort(self, request_id: str) -> None:
        """End a request wherever it is (thread-safe, idempotent); its blocks are freed."""
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def count_rejected(self) -> None:
        """An add that was refused still counts as applied (the API's pending count goes by it)."""
        self.requests_added += 1

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the step loop's thread before the next step (thread-safe): how the serving
        layer drives a migration without touching the scheduler from another thread."""
        self._commands.put(("call", fn))
        self._wakeup.set()

    def wake(self) -> None:
        """Cut an idle driver's wait short (a stop was asked for from another thread)."""
        self._wakeup.set()

    def has_unfinished(self) -> bool:
        return bool(self._requests) or not self._commands.empty()

    def stats(self) -> dict:
        s = self.scheduler
        if s is None:
            return {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
                    "num_preemptions_total": 0, "free_blocks": 0, "total_blocks": 0, "cached_blocks": 0,
                    "prefix_cache_queries": 0, "prefix_cache_hits": 0}
        return {"num_requests_running": len(s.running), "num_requests_waiting": len(s.waiting),
                "kv_cache_usage_perc": s.usage, "num_preemptions_total": s.num_preemptions,
                "free_blocks": s.num_free_blocks, "total_blocks": s.config.num_blocks,
                "cached_blocks": s.num_cached_blocks,  # of free_blocks: cached prefixes, evicted when needed
                "prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
                "watermark_blocks": s.watermark_blocks, "waiting_demand_blocks": s.waiting_demand(),
                "growth_blocks": s.growth_demand(),
                "running_ids": [r.request_id for r in s.running], "waiting_ids": [r.request_id for r in s.waiting],
                "running_blocks": [len(r.block_table) for r in s.running], "requests_added": self.requests_added,
                "step_seconds": self.step_times.snapshot(), "prefill_backlog_s": self._prefill_backlog_s()}

    def _prefill_backlog_s(self):
        """Predicted seconds until the prompts queued here are through (step_cost.prefill_backlog_s:
        every request with more than its next token still to compute, waiting or running). Beside
        running decodes, the ITL target paces prompts to a chunk per step of the target's length,
        which is then the longer figure."""
        s = self.scheduler
        left = [(r.num_computed, r.num_tokens - r.num_computed) for r in (*s.waiting, *s.running)
                if r.num_tokens - r.num_computed > 1]
        compute = prefill_backlog_s(self.step_costs, left)
        decodes = [r for r in s.running if r.num_tokens - r.num_computed <= 1]
        if compute is None or not left or not decodes or self.itl_target is None:
            return compute
        context = sum(r.num_tokens for r in decodes)
        chunk = self._prompt_tokens_within(len(decodes), context, 0)
        if not chunk:
            return compute
        steps = -(-sum(n for _, n in left) // chunk)
        return max(compute, steps * self.step_target_s(len(decodes), context))

    def prefix_events(self) -> tuple[list[int], list[int]]:
        """Driver: the block hashes the prefix cache stored and evicted since the last call."""
        return self.scheduler.allocator.take_events() if self.scheduler is not None else ([], [])

    def _apply_commands(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return outputs
            if command == "add":
                self.requests_added += 1
                arg.seq_id = self._next_seq
                self._next_seq += 1
                self._requests[arg.request_id] = arg
                self.scheduler.add(arg)
            elif command == "call":
                arg()
            elif command == "abort":
                request = self._requests.get(arg)
                if request is not None:
                    request.finish_reason = "abort"
                    outputs.append(self._finish(request, "abort"))

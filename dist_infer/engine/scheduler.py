"""The iteration-level scheduler (Orca, vLLM): every step, one forward batch under a token budget.

Running decodes go first (one token each), then chunks of prompts, so a long prompt never stalls the decodes
(stall-free chunked prefill: Sarathi-Serve, DeepSpeed-FastGen); which prompt first is engine/prompt_order.py's
policy (a failed-over request first under either). New requests are admitted while free KV blocks stay above a
watermark. A running request that needs a block when none is free preempts the newest running request not in
this step nor waiting for a sampled token (pipeline), possibly itself: its blocks are freed and it waits again,
first in line. Sampling is counter-based: it goes on with the tokens it would have drawn.

With prefix caching (prefix_cache.py) an admitted request first takes the longest run of cached full blocks
its tokens match. A full block is registered once a launched step has computed it: at the next `schedule`,
or when its request ends (stop, length), is preempted or moves; not an aborted or failed request's newest
(its step may never have run), nor blocks a migration brought. Speculative decoding (engine/speculative): a
decode's chunk also carries proposals, computed once accepted (`accept_proposed`); blocks holding only
rejected ones go back (`release_unverified`): prefix-cache hashes cover accepted tokens. The scheduler owns
the block pool and every request's block table. Pure bookkeeping: the tests drive it directly.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional, Union

from dist_infer.engine.block_demand import check_fits, cp_rows_needed  # noqa: F401
from dist_infer.engine.block_pool import BlockPool
from dist_infer.engine.kv_cache import blocks_for
from dist_infer.engine.layered_prefill import LayerProgress, group_charge
from dist_infer.engine.prefix_cache import request_block_hashes
from dist_infer.engine.prompt_order import PromptOrder, recovery_tails
from dist_infer.engine.request import Request, RequestStatus
from dist_infer.engine.scheduler_config import SchedulerConfig
from dist_infer.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from dist_infer.engine.speculative.drafter import Drafter

# prompt tokens allowed beside a step's decodes: a number, or (decodes, their context, next chunk's start,
# proposals the decodes verify, that prompt's tokens left) -> tokens
PrefillCap = Union[None, int, Callable[[int, int, int, int, int], Optional[int]]]


class Scheduler:
    def __init__(self, config: SchedulerConfig, cp: int = 1, drafter: Optional[Drafter] = None):
        """`drafter`: proposals for speculative decoding (engine/speculative/drafter.py); None, or cp
        or layered prefill (whose steps cannot verify them): none."""
        if config.prefix_caching and cp > 1:
            raise ValueError(f"prefix caching does not support context parallel (cp={cp}): turn it off")
        self.config = config
        self.cp = cp
        self.drafter = drafter if cp == 1 and config.layered is None else None
        self.allocator = BlockPool(config.num_blocks)
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up in the cache
        self.prefix_cache_hits = 0  # of those, tokens found cached (not computed again)
        self.failover_recomputed_tokens = 0  # tokens resumed requests computed again (the rest: cache hits)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0
        self._freed: list[Request] = []
        self.watermark_blocks = int(config.watermark * config.num_blocks)  # free blocks admission leaves
        # context parallel: the prompt length a sequence was prefilled with (its zigzag layout)
        self._cp_prefill: dict[str, int] = {}
        self._last_step_prefill = False
        self.prompt_order = PromptOrder(config.policy, config.max_wait_s)  # which prompt first

    # -- the queue ----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A request whose instance died goes first, as a preempted one does: its client waits mid-stream."""
        request.status = RequestStatus.WAITING
        (self.waiting.appendleft if request.resumed else self.waiting.append)(request)

    def finish(self, request: Request, reason: str) -> None:
        """End a request wherever it is (finished, stopped, aborted) and free its blocks."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)
        self._release(request, cache=reason in ("stop", "length"))  # an abort may be a step that never ran
        request.status = RequestStatus.FINISHED
        if self.drafter is not None:
            self.drafter.forget(request)
        request.finish_reason = request.finish_reason or reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- migration: a request leaves or joins with its blocks ----------------------------------------
    def pause(self, request: Request) -> None:
        """Take a request out of scheduling, blocks and all (it is moving to another instance)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.MIGRATING

    def resume(self, request: Request) -> None:
        """A paused request goes on here (its move failed)."""
        self.install(request, request.block_table, computed_here=True)

    def hand_over(self, request: Request) -> None:
        """A paused request now lives elsewhere: free its blocks, forget it."""
        self._release(request, cache=True)
        request.status = RequestStatus.FINISHED
        if self.drafter is not None:
            self.drafter.forget(request)

    def install(self, request: Request, blocks: list[int], computed_here: bool = False) -> None:
        """A request arrives with its first `num_computed` tokens in `blocks`: it runs next step
        (or waits for admission, if none of it is computed). Blocks another instance computed (a
        transfer may still be writing them) are never registered in the prefix cache."""
        request.block_table, request.in_flight = list(blocks), False
        if not computed_here:
            request.cacheable, request.num_cached_blocks = False, 0
        if request.num_computed == 0:
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
        else:
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.allocator.num_free / self.config.num_blocks

    # -- blocks -------------------------------------------------------------------------------
    def _tokens_held(self, request: Request, computed: int) -> int:
        """KV rows (per rank) a request holds once `computed` of its tokens are in the cache."""
        if self.cp == 1:
            return computed
        prompt = self._cp_prefill.get(request.request_id, computed)
        return cp_rows_needed(prompt, computed - prompt, self.cp)

    def _blocks_to_grow(self, request: Request, new_tokens: int) -> int:
        need = blocks_for(self._tokens_held(request, request.num_computed + new_tokens), self.config.block_size)
        return max(0, need - len(request.block_table))

    def _grow(self, request: Request, new_tokens: int) -> None:
        for _ in range(self._blocks_to_grow(request, new_tokens)):
            request.block_table.append(self.allocator.allocate())

    def _release(self, request: Request, cache: bool = False) -> None:
        """Free a request's blocks; `cache`: its computed full blocks are sound (their steps left),
        register them first, so they stay cached."""
        if cache:
            self._cache_computed(request)
        if request.block_table:
            self.allocator.free(request.block_table)
            request.block_table = []
        request.num_cached_blocks, request.cacheable = 0, True
        had_cp_shard = self._cp_prefill.pop(request.request_id, None) is not None
        if request.num_computed or had_cp_shard or request.layer_progress is not None:
            self._freed.append(request)  # the ranks drop what they keep of it (cp shards, layered hidden states)
        request.num_computed, request.layer_progress = 0, None
        request.in_flight = False

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute later: free everything, queue it first (it was admitted before the others)."""
        self.running.remove(request)
        self._release(request, cache=True)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    # -- one step ------------------------------------------------------------------------------
    def schedule(
        self, max_seqs: Optional[int] = None, prefill_cap: "PrefillCap" = None, pace_alone: bool = False
    ) -> SchedulerOutput:
        """The next step's batch. The caller launches each step before it asks for the next (or
        fails its requests): what the steps so far computed is then registered in the prefix cache."""
        for request in self.running:
            self._cache_computed(request)
        out = self._schedule(max_seqs, prefill_cap, prompts_first=True, pace_alone=pace_alone)
        if not out.chunks and self.config.whole_prompt_steps:
            # cp: the waiting prompts do not fit yet; the running requests decode (and free blocks)
            out = self._schedule(max_seqs, prefill_cap, prompts_first=False, freed=out.freed, preempted=out.preempted)
        return out

    def _schedule(
        self,
        max_seqs: Optional[int],
        prefill_cap: "PrefillCap",
        prompts_first: bool,
        freed: Optional[list] = None,
        preempted: Optional[list] = None,
        pace_alone: bool = False,
    ) -> SchedulerOutput:
        """The next step's batch (at most `max_seqs` sequences); requests whose sampled token is still on
        the way (pipeline) wait for it. `prefill_cap`: prompt tokens allowed beside the step's decodes (a
        PrefillCap: the engine sizes it to its ITL target); a step without decodes only if `pace_alone`."""
        out = SchedulerOutput(preempted=list(preempted or []))
        max_seqs = max_seqs or self.config.max_num_seqs
        budget = self.config.max_batched_tokens if self.config.max_batched_tokens is not None else float("inf")
        cp_prefill_step = False
        if self.config.whole_prompt_steps:  # alternate: a prefill step after each decode step while prompts wait
            decodes_ready = any(not r.in_flight and r.num_tokens - r.num_computed == 1 for r in self.running)
            cp_prefill_step = (
                prompts_first and bool(self.waiting) and (not decodes_ready or not self._last_step_prefill)
            )
        scheduled: set[int] = set()
        head, deferred = self.prompt_order.start_step(self.waiting), []

        # 1. running requests: every decode, then prompts' chunks, failed-over requests' first (their tails,
        # whole: the ITL cap is for the others), then in prompt_order's order (deferred behind a waiting one)
        if not cp_prefill_step:
            carried, tails = recovery_tails(self.running)
            for decodes in (True, False):
                if not decodes and (out.chunks or pace_alone) and prefill_cap is not None:
                    prompts = [r for r in self.running if not r.in_flight and r.num_tokens - r.num_computed > 1]
                    budget = min(
                        budget, out.prompt_cap(prefill_cap, self.prompt_order.first(prompts, self.waiting)) + tails
                    )
                running = self.running if decodes else self.prompt_order.running_prompts(self.running)
                for request in sorted(running, key=lambda r: carried.get(id(r), len(carried))):
                    if len(out.chunks) >= max_seqs:
                        break
                    if request.resumed and id(request) not in carried:
                        continue  # a later step's: failed-over tails go few at a time, the shortest first
                    if not decodes and head is not None and request.layer_progress is None:
                        if self.prompt_order.key(request) > head:  # a shorter waiting prompt goes first
                            deferred.append(request)
                            continue
                    budget = self._schedule_running(request, decodes, budget, out, scheduled)

        # 2. waiting requests, in prompt_order's order, while blocks and the budget last
        admitting = (
            not self.config.static_batching
            or not self.running
            or all(r.num_computed < r.num_tokens and not r.output_token_ids for r in self.running)
        )
        admitting = admitting and (not self.config.whole_prompt_steps or cp_prefill_step)
        if admitting:  # (shortest-prompt: those before the first deferred prompt, then it, then the rest)
            budget = self._admit(
                out, budget, max_seqs, scheduled, min(map(self.prompt_order.key, deferred), default=None)
            )
        for request in deferred:
            if len(out.chunks) < max_seqs:
                budget = self._schedule_running(request, False, budget, out, scheduled)
        if admitting and deferred:
            self._admit(out, budget, max_seqs, scheduled)
        for chunk in out.chunks:
            chunk.request.resumed = False
        out.freed, self._freed = list(freed or []) + self._freed, []
        if out.chunks:
            self._last_step_prefill = cp_prefill_step
        return out

    def _schedule_running(
        self, request: Request, decodes: bool, budget: float, out: SchedulerOutput, scheduled: set[int]
    ) -> float:
        """Step 1 of `_schedule` for one running request: its decode (with proposals) or its prompt's
        next chunk, preempting the newest requests for blocks if it must; returns the budget left."""
        if request not in self.running or request.in_flight or id(request) in scheduled:
            return budget
        remaining = request.num_tokens - request.num_computed
        if (remaining == 1) != decodes or (self.config.whole_prompt_steps and remaining != 1):
            return budget
        if request.layer_progress is not None:  # its next group runs whatever the budget left
            return budget - self._add_layer_group(out, request, scheduled)
        n = min(remaining, budget) if self.config.chunked_prefill else remaining
        if n <= 0 or n > budget:
            return budget
        while self._blocks_to_grow(request, n) > self.allocator.num_free:
            victim = self._newest_preemptable(exclude=scheduled)
            if victim is None:
                break
            self._preempt(victim, out)
            if victim is request:
                break
        if request.status is not RequestStatus.RUNNING or self._blocks_to_grow(request, n) > self.allocator.num_free:
            return budget
        draft = self._draft(request, budget - n) if decodes else []
        self._grow(request, n + len(draft))
        self._add_chunk(out, request, n, scheduled, draft)
        return budget - n - len(draft)

    def _admit(
        self, out: SchedulerOutput, budget: float, max_seqs: int, scheduled: set[int], until: Optional[tuple] = None
    ) -> float:
        """Step 2 of `_schedule`: start waiting requests in the queue's order (those with a prompt_order
        key below `until`), each from the cached blocks its tokens match (prefix caching), while blocks
        and the budget last; returns the budget left. A step that starts failed-over requests (first
        in the queue) starts no other: its length is their gap."""
        recovering = any(c.request.resumed for c in out.chunks)
        while (
            self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and len(out.chunks) < max_seqs
        ):
            request = self.waiting[0]
            if (recovering and not request.resumed) or (until is not None and self.prompt_order.key(request) > until):
                break
            recovering = request.resumed
            hit = self._match(request)
            cached = len(hit) * self.config.block_size
            remaining = request.num_tokens - cached
            groups = self._layer_groups(remaining, budget)
            if groups > 1 and (
                any(r.layer_progress is not None for r in self.running) or any(c.layers is not None for c in out.chunks)
            ):
                break  # one prompt in its layers at a time (a step holds at most one)
            if groups > 1:
                n = remaining
            elif self.config.chunked_prefill and not self.config.whole_prompt_steps:
                n = min(remaining, budget)
            elif remaining <= budget or not out.chunks:
                n = remaining  # a prompt longer than the budget still runs, alone
            else:
                break
            if self.cp > 1:
                self._cp_prefill[request.request_id] = request.num_tokens
            # the new blocks, and the matched ones nobody holds (they leave the allocatable count)
            grow = self._blocks_to_grow(request, cached + n) - len(hit) + self.allocator.reclaimed_by(hit)
            if grow > self.allocator.num_free - self.watermark_blocks and (self.running or out.chunks):
                self._cp_prefill.pop(request.request_id, None)
                break  # wait for blocks (unless nothing else runs: then take what there is)
            if grow > self.allocator.num_free:
                self._cp_prefill.pop(request.request_id, None)
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if self.config.prefix_caching:
                self.allocator.take(hit)
                request.block_table, request.num_computed, request.num_cached_blocks = hit, cached, len(hit)
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += cached
            self.failover_recomputed_tokens += request.num_tokens - cached if request.resumed else 0
            request.resumed = False
            self._grow(request, n)
            if groups > 1:
                request.layer_progress = LayerProgress(request.num_computed, n, groups)
                budget -= self._add_layer_group(out, request, scheduled)
                continue
            self._add_chunk(out, request, n, scheduled)
            budget -= n
        return budget

    # -- layered prefill (layered_prefill.py) ------------------------------------------------------
    def _layer_groups(self, remaining: int, budget: float) -> int:
        """Groups a prompt with `remaining` tokens to compute is cut into; 1: not layered (it fits
        the budget left, or the schedule is chunked)."""
        layered = self.config.layered
        if layered is None or remaining <= budget:
            return 1
        return layered.groups_for(remaining, budget)

    def _add_layer_group(self, out: SchedulerOutput, request: Request, scheduled: set[int]) -> int:
        """The next group of a layered prompt into `out`; its tokens count as computed with the
        last group. Returns what the step counts against the budget."""
        progress, num_layers = request.layer_progress, self.config.layered.num_layers
        first, end = progress.next_bounds(num_layers)
        sample = progress.last
        progress.done += 1
        if sample:
            request.num_computed, request.layer_progress, request.in_flight = (
                progress.start + progress.tokens,
                None,
                True,
            )
        charge = group_charge(progress.tokens, first, end, num_layers)
        out.chunks.append(ScheduledChunk(request, progress.start, progress.tokens, sample, (first, end), charge))
        scheduled.add(id(request))
        return charge

    # -- prefix caching (prefix_cache.py) ---------------------------------------------------------
    def computed_block_hashes(self, request: Request) -> list[int]:
        """The hashes of the request's full blocks scheduled so far (what a migration's destination
        may hold already); none under cp, whose blocks hold a shard of the tokens, not a run."""
        if self.cp > 1:
            return []
        bs = self.config.block_size
        return list(request_block_hashes(request, min(request.num_computed // bs, len(request.block_table)), bs))

    def _match(self, request: Request) -> list[int]:
        """The cached blocks a waiting request starts from: the longest matching run of its full
        blocks, short of its last token (which is computed, into a block of its own, to sample from)."""
        if not self.config.prefix_caching:
            return []
        bs = self.config.block_size
        return self.allocator.match(request_block_hashes(request, (request.num_tokens - 1) // bs, bs))

    def _cache_computed(self, request: Request) -> None:
        """Register the full blocks of `request` launched steps computed (its next tokens go to later blocks)."""
        if not self.config.prefix_caching or not request.cacheable:
            return
        end = request.num_computed if self.config.cache_generated else request.computed_prompt
        full = min(end // self.config.block_size, len(request.block_table))
        if full <= request.num_cached_blocks:
            return
        hashes = request_block_hashes(request, full, self.config.block_size)
        for i in range(request.num_cached_blocks, full):
            self.allocator.register(request.block_table[i], hashes[i])
        request.num_cached_blocks = full

    @property
    def num_cached_blocks(self) -> int:
        """Cached blocks no request holds: allocatable (in `num_free_blocks`), evicted only when needed."""
        return self.allocator.num_evictable

    def _add_chunk(
        self, out: SchedulerOutput, request: Request, n: int, scheduled: set[int], draft: Optional[list] = None
    ) -> None:
        """`n` of the request's tokens into the step, then `draft` (proposals, not counted computed)."""
        start, draft = request.num_computed, list(draft or [])
        request.num_computed += n
        request.in_flight = sample = request.num_computed == request.num_tokens
        out.chunks.append(ScheduledChunk(request, start, n + len(draft), sample, draft=draft))
        scheduled.add(id(request))

    # -- speculative decoding (engine/speculative) ---------------------------------------------------
    def _draft(self, request: Request, budget: float) -> list[int]:
        """The drafter's proposals for a decode, cut to the token budget left, the request's
        max_tokens (the step emits one token past the accepted ones) and the free blocks."""
        if self.drafter is None or budget < 1:
            return []
        room = request.params.max_new_tokens - len(request.output_token_ids) - 1
        draft = self.drafter.propose(request, int(min(budget, room)))
        while draft and self._blocks_to_grow(request, 1 + len(draft)) > self.allocator.num_free:
            draft.pop()
        return draft

    def accept_proposed(self, request: Request) -> None:
        """The proposal the driver just appended to `request` was accepted: its KV counts."""
        request.num_computed += 1

    def release_unverified(self, request: Request) -> None:
        """After a speculating step: blocks past the computed tokens (rejected proposals) go back."""
        if request.status is not RequestStatus.RUNNING:
            return
        keep = blocks_for(self._tokens_held(request, request.num_computed), self.config.block_size)
        if len(request.block_table) > keep:
            self.allocator.free(request.block_table[keep:])
            del request.block_table[keep:]

    def _newest_preemptable(self, exclude: set[int]) -> Optional[Request]:
        for request in reversed(self.running):
            if not request.in_flight and id(request) not in exclude:
                return request
        return None

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> Optional[str]:
        """Why a request can never run here (its full length needs more blocks than there are), or None."""
        return check_fits(prompt_len, max_new_tokens, self.config.num_blocks, self.config.block_size, self.cp)

    def on_sampled(self, request: Request) -> None:
        """The token sampled for `request`'s last chunk arrived (the caller appended it)."""
        request.in_flight = False

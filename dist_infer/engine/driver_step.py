"""The driver's step: plan a step, launch it, complete the oldest in flight.

With pipeline parallelism up to pp steps are in flight at once, each on about 1/pp of the live
requests, so every stage stays busy. Completing a step hands each sampled row to its request
(request_progress.py); a request that fails in its step fails alone (step_guard.py). A row whose
request has a grammar (structured outputs) gets its token bitmask as the step is planned: the
request is in no other step, so its grammar state is the one this step samples from. Where the
driver samples, the masks are computed while the forward runs (structured/mask_filler.py). A
speculating row's proposals are kept while the target's tokens at their positions match them
(engine/speculative): the target drew each of those as a plain step would have.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from dist_infer.engine.intake import RequestRegistry
from dist_infer.engine.kv_transfer import TransferOp
from dist_infer.engine.pipeline import PipelineTransport
from dist_infer.engine.request import RequestOutput
from dist_infer.engine.request_progress import RequestProgress
from dist_infer.engine.sampling import SampledTokens
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.scheduler_output import SchedulerOutput
from dist_infer.engine.speculative.verification import accepted_prefix
from dist_infer.engine.stage_runner import StageRunner
from dist_infer.engine.step_guard import StepGuard, failed_error_id
from dist_infer.engine.step_pacing import StepPacer
from dist_infer.engine.step_plan import KIND_IDLE, KIND_STOP, KIND_WORK, StepPlan
from dist_infer.engine.structured.mask_filler import MaskFiller, lift_eos_bans
from dist_infer.engine.worker import StageWorker


@dataclass
class InFlightStep:
    """A launched step the driver has not completed yet (up to pp of them at once)."""

    plan: StepPlan
    chunks: list  # the scheduler's chunks, in plan order
    launched: float
    result: Optional[SampledTokens] = None  # pp=1: sampled at launch; pp>1: comes back from the last stage


class StepDriver:
    """Driver only: the steps. Takes the queued commands (`registry`), schedules (`scheduler`,
    paced by `pacer`), checks each plan with `worker` before it leaves, sends it (`transport`)
    and runs the driver's own share (`runner`), and hands the sampled rows to their requests
    (`progress`); `guard` fails what fails. `model_cfg`: the model's limits a plan is checked
    against; `world_size`: the instance's ranks (one alone may survive a failed forward);
    `heartbeat_s`: the idle plan's period; `first_step`: the number of the next plan; `masks`: fills
    the grammar masks of constrained rows (structured outputs; None: one of its own)."""

    def __init__(
        self,
        scheduler: Scheduler,
        worker: StageWorker,
        runner: StageRunner,
        transport: PipelineTransport,
        registry: RequestRegistry,
        progress: RequestProgress,
        pacer: StepPacer,
        guard: StepGuard,
        *,
        model_cfg,
        world_size: int,
        heartbeat_s: float,
        first_step: int = 0,
        masks: Optional[MaskFiller] = None,
    ):
        self.scheduler, self.worker, self.runner, self.transport = scheduler, worker, runner, transport
        self.masks = masks if masks is not None else MaskFiller()
        self.registry, self.progress, self.pacer, self.guard = registry, progress, pacer, guard
        self.model_cfg, self.world_size, self.heartbeat_s = model_cfg, world_size, heartbeat_s
        self.next_step = first_step
        self.completed_steps = 0
        self.return_logits = False  # the work plans ask for the logits too (offline generate, tests)
        self.last_plan = time.monotonic()
        self._inflight: deque[InFlightStep] = deque()
        self._freed: list[int] = []
        self._transfers: list[TransferOp] = []  # KV block moves for the next plan (live migration)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def queue_transfer(self, op: TransferOp) -> None:
        """A KV block move every rank makes with the next plan (sent at once if idle)."""
        self._transfers.append(op)

    def step(self, pace_alone: bool = False) -> list[RequestOutput]:
        """Launch steps until pp are in flight (or nothing is schedulable), then complete the
        oldest. Returns what the completed step added to each request. `pace_alone`: a step of
        prompts alone keeps the ITL target too (streams may arrive mid-step: failovers)."""
        outputs = self._apply_commands()
        while len(self._inflight) < self.transport.stages:
            self._price_proposals()
            scheduled = self.scheduler.schedule(self._seqs_per_step(), self.pacer.prefill_cap(), pace_alone)
            self._freed += [r.seq_id for r in scheduled.freed]
            if not scheduled.chunks:
                break
            before = len(self._inflight)
            outputs += self._launch(scheduled)
            if len(self._inflight) == before:
                break  # the step failed before it ran (its requests with it): the next one goes on
        if self._transfers:  # nothing to run this step, but blocks to move: an idle plan carries them
            self._send_plan(
                StepPlan(
                    kind=KIND_IDLE, step=self.next_step, freed=self._take_freed(), transfers=self._take_transfers()
                )
            )
        if self._inflight:
            outputs += self._complete(self._inflight.popleft())
        elif time.monotonic() - self.last_plan > self.heartbeat_s:
            self._send_plan(StepPlan(kind=KIND_IDLE, step=self.next_step, freed=self._take_freed()))
        return outputs

    def _apply_commands(self) -> list[RequestOutput]:
        """The commands other threads queued: new requests join the scheduler, aborts end theirs."""
        outputs = []
        for command, arg in self.registry.take_commands():
            if command == "add":
                self.registry.count_added()
                self.registry.register(arg)
                self.scheduler.add(arg)
            elif command == "call":
                arg()
            elif command == "abort":
                request = self.registry.find(arg)
                if request is not None:
                    request.finish_reason = "abort"
                    outputs.append(self.progress.finish(request, "abort"))
        return outputs

    def _price_proposals(self) -> None:
        """Speculative decoding: what a proposed token costs in the next step, for the drafter; a draft
        model's proposals for the step's decodes."""
        drafter, running = self.scheduler.drafter, self.scheduler.running
        if drafter is not None and running:
            drafter.row_cost, drafter.step_cost = self.pacer.draft_prices(
                len(running), sum(r.num_tokens for r in running)
            )
            drafter.prepare(running)  # a draft model drafts the step's decodes at once

    def _seqs_per_step(self) -> Optional[int]:
        """With pp stages, each step takes about 1/pp of the live requests, so pp steps on
        different requests chase each other through the stages (prefill and decode alike)."""
        stages = self.transport.stages
        if stages == 1:
            return None
        live = len(self.scheduler.running) + len(self.scheduler.waiting)
        return max(1, -(-live // stages))

    def _take_freed(self) -> list[int]:
        freed, self._freed = self._freed, []
        return freed

    def _take_transfers(self) -> list[TransferOp]:
        transfers, self._transfers = self._transfers, []
        return transfers

    def _send_plan(self, plan: StepPlan, meta: Optional[object] = None) -> Optional[SampledTokens]:
        """The plan to every rank of stage 0, then the driver's own share of it."""
        wire = self.transport.broadcast_plan(plan)
        self.last_plan = time.monotonic()
        return self.runner.run(plan, wire, meta=meta)

    def _launch(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """Plan the step and send it. A request whose chunk cannot be planned fails alone; a plan
        the metadata check rejects, or (one rank) a forward that raises, fails the step's
        requests. Returns the failed requests' outputs."""
        plan = StepPlan(kind=KIND_WORK, step=self.next_step, return_logits=self.return_logits)
        config = self.scheduler.config
        chunks, failed = self.guard.plan_chunks(
            plan, scheduled.chunks, self.model_cfg, config.num_blocks, config.block_size, self.scheduler.cp
        )
        if not chunks:
            return failed
        requests = [c.request for c in chunks]
        try:
            meta = self.worker.prepare(plan)  # before the plan leaves: a bad plan stops here, on the driver
        except Exception as exc:  # noqa: BLE001
            return failed + self.guard.fail_all(requests, "checking its step", exc)
        failed += self._grammar_masks(plan, chunks)
        plan.freed, plan.transfers = self._take_freed(), self._take_transfers()
        self.next_step += 1
        launched = time.perf_counter()
        try:
            result = self._send_plan(plan, meta)
        except Exception as exc:  # noqa: BLE001
            if plan.pending_masks is not None:
                plan.pending_masks.settle()  # the fill ends before its grammar states are touched again
            self.guard.forward_failed(exc, self.world_size)  # re-raises unless this is the only rank
            return failed + self.guard.fail_all(requests, "its step's forward", exc)
        self.guard.forward_ok()
        self._inflight.append(InFlightStep(plan, chunks, launched, result))
        return failed

    def _grammar_masks(self, plan: StepPlan, chunks: list) -> list[RequestOutput]:
        """The token bitmasks of the plan's rows whose requests have a grammar (a step with none
        gets none). Where the driver samples they are started on the mask filler's thread, to be
        taken by the sampler after the forward; else filled now, into the plan. Where the grammar
        can only end, EOS is allowed below min_tokens too. A fill that raises fails those
        requests alone (their rows' tokens are then dropped)."""
        sampled = [c.request for c in chunks if c.sample]
        constrained = [(b, r) for b, r in enumerate(sampled) if r.grammar is not None]
        if not constrained:
            return []
        rows, matchers = [b for b, _ in constrained], [r.grammar for _, r in constrained]
        if self.runner.is_sampler and self.transport.stages == 1:
            plan.pending_masks = self.masks.start(rows, matchers)
            return []
        began = time.perf_counter()
        try:
            masks = self.masks.fill(matchers)
        except Exception as exc:  # noqa: BLE001 - these requests' own grammars
            return self.guard.fail_all([r for _, r in constrained], "computing its grammar mask", exc)
        finally:  # filled before the plan leaves: none of it hidden
            self.masks.counters.add(mask_wait_seconds=time.perf_counter() - began)
        lift_eos_bans(plan.rows, rows, masks, self.model_cfg.eos_token_ids)
        plan.mask_rows, plan.masks = rows, masks
        return []

    def _complete(self, flight: InFlightStep) -> list[RequestOutput]:
        """The oldest step's tokens to their requests (a failed row fails its request alone)."""
        sampled = flight.result if flight.result is not None else self.transport.receive_sampled(flight.plan)
        self.pacer.learn(flight.chunks, flight.launched, time.perf_counter())
        now = time.monotonic()
        outputs = []
        rows = [c for c in flight.chunks if c.sample]
        at = 0  # the row's first sampled position (a speculating row has 1 + its proposals)
        for chunk in rows:
            r, i = chunk.request, at
            at += 1 + len(chunk.draft)
            if r.finished or not r.in_flight:
                continue  # aborted (or preempted and requeued) while the step was on its way
            targets = sampled.tokens[i:at].tolist()
            error_id = next((e for e in map(failed_error_id, targets) if e is not None), None)
            if error_id is not None:  # logged on the sampler rank
                outputs.append(self.guard.fail(r, "sampling", error_id))
                continue
            try:
                outputs.append(self._take(r, chunk.draft, targets, sampled, i, flight.plan.return_logits, now))
            except Exception as exc:  # noqa: BLE001 - stop checks, detokenizing: this request's own
                outputs += self.guard.fail_all([r], "taking its token", exc)
        self.completed_steps += 1
        return outputs

    def _take(
        self, r, draft: list[int], targets: list[int], sampled: SampledTokens, i: int, logits: bool, now: float
    ) -> RequestOutput:
        """Row `i` of the step's tokens to `r`; a speculating row's proposals checked against the
        target's tokens at their positions (`targets`): the matching run and the target's next."""
        if not draft:
            return self.progress.take_token(r, sampled, i, logits, now)
        accepted = accepted_prefix(draft, targets)
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.record(r, len(draft), accepted)
        return self.progress.take_tokens(r, sampled, i, accepted, logits, now)

    def stop_followers(self) -> None:
        """Complete what is in flight, then tell every other rank the loop is over."""
        while self._inflight:
            self._complete(self._inflight.popleft())
        self._send_plan(
            StepPlan(kind=KIND_STOP, step=self.next_step, freed=self._take_freed(), transfers=self._take_transfers())
        )
        self.transport.drain()

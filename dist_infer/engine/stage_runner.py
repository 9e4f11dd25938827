"""This rank's share of each plan, and the follower loop that runs the plans as they come.

Every rank runs every plan: it forgets the sequences the plan freed, makes the plan's KV block
moves (live migration), and on a work step runs its stage of the model, then passes the plan on
to the next stage or, on the last stage's sampler rank, samples the flagged rows. The driver
runs its share as it sends a plan (driver_step.py); every other rank runs `follow` until a stop
plan. The messages themselves are pipeline.py's. A row with a grammar (structured outputs) is
masked by its bitmask before it is sampled, so its logprobs are the masked ones: from the plan, or
(the driver samples) taken from the mask filler once the forward is done.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from dist_infer.engine.device_io import host_index, sampled_to_host, to_host
from dist_infer.engine.kv_transfer import BlockMover
from dist_infer.engine.pipeline import PipelineTransport
from dist_infer.engine.sampling import SampledTokens, sample_rows
from dist_infer.engine.step_guard import StepGuard, failed_token, log_exception
from dist_infer.engine.step_plan import KIND_STOP, KIND_WORK, StepPlan
from dist_infer.engine.structured.mask_filler import lift_eos_bans
from dist_infer.engine.structured.token_mask import apply_bitmask_
from dist_infer.engine.worker import StageWorker


class StageRunner:
    """Every rank: run `stage`'s share of each plan on `worker`. The sampler rank samples with
    `sampler` (logits, rows, EOS ids -> SampledTokens; None: sampling.sample_rows), guarded by
    `guard` so a failing row fails alone; `mover` makes the plans' KV block moves (None: no
    migration yet, `attach` adds it)."""

    def __init__(
        self,
        stage,
        worker: StageWorker,
        transport: PipelineTransport,
        guard: StepGuard,
        sampler: Optional[Callable[..., SampledTokens]],
        is_sampler: bool,
        cp_size: int,
        mover: Optional[BlockMover] = None,
    ):
        self.stage, self.worker, self.transport, self.guard = stage, worker, transport, guard
        self.sampler, self.is_sampler, self.cp_size = sampler, is_sampler, cp_size
        self.mover = mover
        self._prefill_start: Optional[tuple[float, float]] = None  # a timed follower's clocks at its start
        self._prefill_s = (0.0, 0.0)  # its wall and CPU seconds up to its first sampled forward

    def attach(self, mover: BlockMover) -> None:
        """Make the KV block moves of the plans from now on (live migration was enabled)."""
        self.mover = mover

    def run(
        self,
        plan: StepPlan,
        wire: Optional[list[torch.Tensor]],
        hidden: Optional[torch.Tensor] = None,
        meta: Optional[object] = None,
    ) -> Optional[SampledTokens]:
        """This rank's share of a plan as it arrived (`wire`: its encoded tensors, passed on
        unchanged; `hidden`: the previous stage's output; `meta`: its metadata, if the driver
        built it already): forget freed sequences, run the stage on a work step, pass it on, or
        sample (the sampler rank: the tokens, on the host)."""
        self.worker.forget(plan.freed)
        if self.mover is not None:
            for op in plan.transfers:  # before the forward: a commit's blocks are in before they are read
                self.mover.apply(op)
            self.mover.poll()
        last_stage = self.transport.last_stage
        if plan.kind != KIND_WORK:
            if not last_stage:
                self.transport.pass_on(wire)
            return None
        if meta is None and self.cp_size == 1:
            meta = self.worker.prepare(plan)
        inputs = hidden if hidden is not None else self.worker.token_inputs(plan, meta)
        out = self.worker.execute(plan, inputs, meta)
        if self._prefill_start is not None and any(plan.sample):  # this rank's own prefill ends here
            wall, cpu = self._prefill_start
            self._prefill_s = (time.perf_counter() - wall, time.process_time() - cpu)
            self._prefill_start = None
        if not last_stage:
            self.transport.pass_on(wire + [out])
            return None
        if not self.is_sampler:
            return None
        return self._sample(plan, out)

    def _sample(self, plan: StepPlan, out: torch.Tensor) -> SampledTokens:
        """The sampler rank: the plan's flagged rows of the last stage's logits, sampled (and sent
        back to the driver under pp)."""
        rows = plan.sample_index
        # sample_index is sorted and distinct: as many rows as out has is every row (a decode step), no gather
        logits = out if len(rows) == out.shape[0] else out[host_index(rows, out.device)]
        sample = self.sampler or sample_rows  # looked up here: a test may replace the module's sampler
        eos_ids = tuple(self.stage.cfg.eos_token_ids)
        unmasked, error_id = self._take_pending_masks(plan, eos_ids)
        # a grammar's row is one sampled position (it never speculates): where it sits among them
        at = plan.row_offsets() if plan.speculative else None
        allowed = logits
        if plan.mask_rows:  # a copy: the model's own logits stay what return_logits gives
            positions = plan.mask_rows if at is None else [at[b] for b in plan.mask_rows]
            allowed = apply_bitmask_(logits.clone(), plan.masks, positions)
        sampled = self.guard.sample(sample, allowed, plan, eos_ids)
        sampled = sampled_to_host(sampled)  # the driver reads them, and a pipeline sends them, from the host
        for b in unmasked:  # their grammar failed: so do they
            sampled.tokens[b if at is None else at[b]] = failed_token(error_id)
        if plan.return_logits:
            sampled.logits = to_host(logits.float())
        if self.transport.stages > 1:
            self.transport.send_sampled(sampled, plan)
        return sampled

    @staticmethod
    def _take_pending_masks(plan: StepPlan, eos_ids: tuple[int, ...]) -> tuple[list[int], str]:
        """The masks the driver started before the forward, into the plan (`mask_rows`, `masks`).
        If their fill raised: the rows it was for (they fail) and the error id it is logged under."""
        pending, plan.pending_masks = plan.pending_masks, None
        if pending is None:
            return [], ""
        try:
            masks = pending.result()
        except Exception as exc:  # noqa: BLE001 - these rows' own grammars
            return pending.rows, log_exception(exc, f"step {plan.step}: grammar masks of rows {pending.rows} failed")
        lift_eos_bans(plan.rows, pending.rows, masks, eos_ids)
        plan.mask_rows, plan.masks = pending.rows, masks
        return [], ""

    def follow(self, time_prefill: bool = False) -> tuple[float, float]:
        """Every rank but the driver: run the plans as they come, until the driver says stop.
        `time_prefill`: returns this rank's wall and CPU seconds up to its first sampled forward
        (its own prefill; a profile splits there); else (0, 0)."""
        self._prefill_s = (0.0, 0.0)
        self._prefill_start = (time.perf_counter(), time.process_time()) if time_prefill else None
        while self.follow_one():
            pass
        return self._prefill_s

    def follow_one(self) -> bool:
        """Every rank but the driver: wait for the next plan and run it; False once it said stop."""
        width = getattr(self.stage, "input_width", self.stage.cfg.hidden_size)  # 2H inside a ladder range
        plan, wire, hidden = self.transport.receive_plan(width, self.stage.dtype, self.worker.device)
        self.run(plan, wire, hidden)
        if plan.kind == KIND_STOP:
            self.transport.drain()
            return False
        return True

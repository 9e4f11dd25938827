"""Pipeline transport and the follower loop: how plans, hidden states and sampled tokens move.

The driver broadcasts each plan to the ranks of the first pipeline stage; each stage runs its
share and sends the plan on with its hidden states; the last stage's sampler rank samples and
sends the tokens back to the driver. Every rank but the driver runs `follow` until a stop plan.

Plans and sampled tokens are host values and travel as host tensors (the driver and the
scheduler need them there); hidden states stay on the model's device, sent and received there.
Both ends of every message agree on the device, as NCCL (CUDA) and gloo (CPU) each require.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from dist_infer.engine.device_io import host_index, sampled_to_host, to_host
from dist_infer.engine.sampling import SampledTokens, sample_rows
from dist_infer.engine.step_plan import KIND_STOP, KIND_WORK, StepPlan, decode, encode, sizes

TAG_FORWARD, TAG_BACK = 1, 2


class PipelineTransport:
    """Engine mixin, every rank: send and receive plans, run this rank's stage, pass tokens back.
    Uses the engine's pp and stage communicators, worker, mover, guard and `_pending`."""

    def _send_plan(self, plan: StepPlan, meta: Optional[object] = None) -> Optional[SampledTokens]:
        """Driver: the plan to every rank of stage 0 (one broadcast of its sizes, two of its
        payload), then this rank's own share of it."""
        comm = self.stage_comm
        wire = None  # a rank alone (no stage group, no later stage) needs no encoded plan
        if comm.size > 1 or self.pp.size > 1:
            ints, floats = encode(plan)
            wire = [sizes(ints, floats), ints, floats]
        if comm.size > 1:
            for t in wire:
                if t.numel():
                    comm.broadcast(t, 0)
        self._last_plan = time.monotonic()
        return self._run_stage(plan, wire, meta=meta)

    def _run_stage(self, plan: StepPlan, wire: Optional[list[torch.Tensor]], hidden: Optional[torch.Tensor] = None,
                   meta: Optional[object] = None) -> Optional[SampledTokens]:
        """This rank's share of a plan as it arrived (`wire`: its encoded tensors, passed on
        unchanged): forget freed sequences, run the stage on a work step, pass it on, or sample
        (the sampler rank)."""
        self.worker.forget(plan.freed)
        if self.mover is not None:
            for op in plan.transfers:  # before the forward: a commit's blocks are in before they are read
                self.mover.apply(op)
            self.mover.poll()
        last_stage = self.pp.rank == self.pp.size - 1
        if plan.kind != KIND_WORK:
            if not last_stage:
                self._post(wire, self.pp.rank + 1, TAG_FORWARD)
            return None
        if meta is None and self.cp.size == 1:
            meta = self.worker.prepare(plan)
        inputs = hidden if hidden is not None else self.worker.token_inputs(plan, meta)
        out = self.worker.execute(plan, inputs, meta)
        if self._follower_start is not None and any(plan.sample):  # this rank's own prefill ends here
            wall, cpu = self._follower_start
            self.timing.ttft_s, self.timing.ttft_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
            self._follower_start = None
        if not last_stage:
            self._post(wire + [out], self.pp.rank + 1, TAG_FORWARD)
            return None
        if not self.is_sampler:
            return None
        rows = plan.sample_index
        # sample_index is sorted and distinct: as many rows as out has is every row (a decode step), no gather
        logits = out if len(rows) == out.shape[0] else out[host_index(rows, out.device)]
        sample = self.sampler or sample_rows  # looked up here: a test may replace the module's sampler
        sampled = self.guard.sample(sample, logits, plan, tuple(self.cfg.eos_token_ids))
        sampled = sampled_to_host(sampled)  # the driver reads them, and a pipeline sends them, from the host
        if plan.return_logits:
            sampled.logits = to_host(logits.float())
        if self.pp.size > 1:
            k = plan.top_logprobs
            ints = torch.cat([sampled.tokens, sampled.top_ids.reshape(-1)]) if k else sampled.tokens
            floats = torch.cat([sampled.logprobs, sampled.top_logprobs.reshape(-1)]) if k else sampled.logprobs
            msg = [ints.contiguous(), floats.contiguous()] + ([sampled.logits.contiguous()] if plan.return_logits else [])
            self._post(msg, 0, TAG_BACK)
        return sampled

    def _receive_sampled(self, plan: StepPlan) -> SampledTokens:
        """Driver, pp > 1: the last stage's tokens for `plan`."""
        n, k, last = len(plan.rows), plan.top_logprobs, self.pp.size - 1
        ints = torch.empty(n * (1 + k), dtype=torch.long)
        floats = torch.empty(n * (1 + k), dtype=torch.float64)
        self.pp.recv(ints, last, TAG_BACK)
        self.pp.recv(floats, last, TAG_BACK)
        sampled = SampledTokens(ints[:n], floats[:n], ints[n:].view(n, k), floats[n:].view(n, k))
        if plan.return_logits:
            sampled.logits = torch.empty(n, self.cfg.vocab_size, dtype=torch.float32)
            self.pp.recv(sampled.logits, last, TAG_BACK)
        return sampled

    def _post(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        for t in tensors:
            self._pending.append(self.pp.isend(t.contiguous(), dst, tag))
        self._pending = [h for h in self._pending if not h.is_completed()]

    def _drain(self) -> None:
        for h in self._pending:
            h.wait()
        self._pending = []


    def _receive_plan(self) -> tuple[StepPlan, list[torch.Tensor], Optional[torch.Tensor]]:
        """Follower: the next plan (from the driver's broadcast on stage 0, from the previous
        stage after it), its encoded tensors, and the hidden states of a work step (stage > 0)."""
        if self.pp.rank == 0:
            receive = lambda t: self.stage_comm.broadcast(t, 0)  # noqa: E731
        else:
            receive = lambda t: self.pp.recv(t, self.pp.rank - 1, TAG_FORWARD)  # noqa: E731
        n = torch.empty(2, dtype=torch.long)
        receive(n)
        ints, floats = torch.empty(int(n[0]), dtype=torch.long), torch.empty(int(n[1]), dtype=torch.float64)
        for t in (ints, floats):
            if t.numel() or self.pp.rank > 0:  # the broadcast skips empty payloads; sends carry them
                receive(t)
        plan = decode(ints, floats)
        hidden = None
        if plan.kind == KIND_WORK and self.pp.rank > 0:
            width = getattr(self.stage, "input_width", self.cfg.hidden_size)  # 2H inside a ladder range
            hidden = torch.empty(plan.total_tokens, width, dtype=self.stage.dtype,
                                 device=self.worker.device)  # the previous stage sends its device's tensor
            receive(hidden)
        return plan, [n, ints, floats], hidden

    def follow(self) -> None:
        """Every rank but the driver: run the plans as they come, until the driver says stop."""
        while self.follow_one():
            pass

    def follow_one(self) -> bool:
        """Every rank but the driver: wait for the next plan and run it; False once it said stop."""
        plan, wire, hidden = self._receive_plan()
        self._run_stage(plan, wire, hidden)
        if plan.kind == KIND_STOP:
            self._drain()
            return False
        return True

    def stop_followers(self) -> None:
        """Driver: tell every other rank the loop is over."""
        while self._inflight:
            self._complete(self._inflight.popleft())
        self._send_plan(StepPlan(kind=KIND_STOP, step=self._step, freed=self._take_freed(),
                                 transfers=self._take_transfers()))
        self._drain()

"""Pipeline transport: how plans, hidden states and sampled tokens move between the ranks.

The driver broadcasts each plan to the ranks of the first pipeline stage; each stage runs its
share and sends the plan on with its hidden states; the last stage's sampler rank samples and
sends the tokens back to the driver (what each rank runs is stage_runner.py's).

Plans and sampled tokens are host values and travel as host tensors (the driver and the
scheduler need them there); hidden states stay on the model's device, sent and received there.
Both ends of every message agree on the device, as NCCL (CUDA) and gloo (CPU) each require.
"""

from __future__ import annotations

from typing import Optional

import torch

from dist_infer.comm.base import Communicator, Handle
from dist_infer.engine.sampling import SampledTokens
from dist_infer.engine.step_plan import KIND_WORK, StepPlan, decode, encode, sizes

TAG_FORWARD, TAG_BACK = 1, 2


class PipelineTransport:
    """Every rank: the step loop's messages over `pp` (the pipeline's ranks of this rank's tp/cp
    coordinates) and `stage_comm` (the ranks of this rank's stage; the driver broadcasts plans on
    stage 0's). Sends are asynchronous; `drain` waits for the ones still out. `vocab_size`: the
    width of the logits a plan that returns them sends back."""

    def __init__(self, pp: Communicator, stage_comm: Communicator, vocab_size: int):
        self.pp, self.stage_comm, self.vocab_size = pp, stage_comm, vocab_size
        self._pending: list[Handle] = []

    @property
    def stages(self) -> int:
        return self.pp.size

    @property
    def last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def broadcast_plan(self, plan: StepPlan) -> Optional[list[torch.Tensor]]:
        """Driver: the plan to every rank of stage 0 (one broadcast of its sizes, two of its
        payload). Returns its encoded tensors, for a later stage (None: a rank alone needs none)."""
        comm = self.stage_comm
        wire = None
        if comm.size > 1 or self.pp.size > 1:
            ints, floats = encode(plan)
            wire = [sizes(ints, floats), ints, floats]
        if comm.size > 1:
            for t in wire:
                if t.numel():
                    comm.broadcast(t, 0)
        return wire

    def pass_on(self, tensors: list[torch.Tensor]) -> None:
        """A plan's tensors (and a work step's hidden states) to the next stage."""
        self._post(tensors, self.pp.rank + 1, TAG_FORWARD)

    def send_sampled(self, sampled: SampledTokens, plan: StepPlan) -> None:
        """The last stage's sampler rank: the tokens of `plan` back to the driver (pp > 1)."""
        k = plan.top_logprobs
        ints = torch.cat([sampled.tokens, sampled.top_ids.reshape(-1)]) if k else sampled.tokens
        floats = torch.cat([sampled.logprobs, sampled.top_logprobs.reshape(-1)]) if k else sampled.logprobs
        msg = [ints.contiguous(), floats.contiguous()] + ([sampled.logits.contiguous()] if plan.return_logits else [])
        self._post(msg, 0, TAG_BACK)

    def receive_sampled(self, plan: StepPlan) -> SampledTokens:
        """Driver, pp > 1: the last stage's tokens for `plan`."""
        n, k, last = plan.num_sampled, plan.top_logprobs, self.pp.size - 1  # a row per sampled position
        ints = torch.empty(n * (1 + k), dtype=torch.long)
        floats = torch.empty(n * (1 + k), dtype=torch.float64)
        self.pp.recv(ints, last, TAG_BACK)
        self.pp.recv(floats, last, TAG_BACK)
        sampled = SampledTokens(ints[:n], floats[:n], ints[n:].view(n, k), floats[n:].view(n, k))
        if plan.return_logits:
            sampled.logits = torch.empty(n, self.vocab_size, dtype=torch.float32)
            self.pp.recv(sampled.logits, last, TAG_BACK)
        return sampled

    def receive_plan(
        self, width: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[StepPlan, list[torch.Tensor], Optional[torch.Tensor]]:
        """Follower: the next plan (from the driver's broadcast on stage 0, from the previous
        stage after it), its encoded tensors, and the hidden states of a work step (stage > 0:
        [tokens, width] of `dtype` on `device`, where the previous stage sends them from)."""
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
            hidden = torch.empty(plan.total_tokens, width, dtype=dtype, device=device)
            receive(hidden)
        return plan, [n, ints, floats], hidden

    def _post(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        for t in tensors:
            self._pending.append(self.pp.isend(t.contiguous(), dst, tag))
        self._pending = [h for h in self._pending if not h.is_completed()]

    def drain(self) -> None:
        """Wait for every send still out (before the loop ends)."""
        for h in self._pending:
            h.wait()
        self._pending = []

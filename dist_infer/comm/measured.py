"""A communicator that measures how long communication keeps its caller waiting, and can run
its ops without overlap or not at all, so that overlap becomes a number.

`dist-infer bench --overlap-report` runs one workload up to three ways per group: "serial" (every
async op waited for the moment it is posted: nothing overlaps, the baseline), "overlap" (the
normal schedule) and "skip" (no communication: wrong output, the lower bound). The hidden
fraction is (t_serial - t_overlap) / (t_serial - t_skip), TokenWeave's measure. In every mode
`exposed_s` counts the seconds the caller spent inside communication calls and waits: the
part of communication that computation did not hide.

"serial" suits collectives and paired send/receive batches (rings). A lone blocking send can
deadlock a schedule that relies on sends not blocking (pipeline microbatches), so the bench
does not serialise the pp group.

Skipping keeps what the schedule itself needs: integer tensors (pipeline headers, token ids,
ring layouts) still travel, only floating-point payloads (activations, partial sums, logits,
KV chunks) are skipped.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional

import torch
from torch.autograd.profiler import record_function

from dist_infer.comm.base import Communicator, DoneHandle, Handle
from dist_infer.comm.delegating import DelegatingCommunicator

MODES = ("overlap", "serial", "skip")


def _profiling() -> bool:
    return torch._C._autograd._profiler_enabled()


class _Span:
    """Adds the seconds inside the `with` to the owner's exposed time (and names them in a profile)."""

    __slots__ = ("owner", "op", "range", "t0")

    def __init__(self, owner: "MeasuredCommunicator", op: str):
        self.owner, self.op = owner, op

    def __enter__(self):
        self.range = record_function(f"dist_infer::comm::{self.owner.name}.{self.op}") if _profiling() else None
        if self.range is not None:
            self.range.__enter__()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.owner.exposed_s[self.op] += time.perf_counter() - self.t0
        if self.range is not None:
            self.range.__exit__(*exc)


class _TimedHandle(Handle):
    """The inner handle, with the time spent in wait() added to the owner's exposed time."""

    def __init__(self, owner: "MeasuredCommunicator", op: str, inner: Handle):
        self.owner, self.op, self.inner = owner, op, inner

    def is_completed(self) -> bool:
        return self.inner.is_completed()

    def wait(self, timeout: Optional[float] = None) -> None:
        with _Span(self.owner, self.op):
            self.inner.wait(timeout)


class MeasuredCommunicator(DelegatingCommunicator):
    """`inner`, timed; `mode` picks overlap (normal), serial (no overlap) or skip (no communication)."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self.mode = "overlap"
        self.exposed_s: dict[str, float] = defaultdict(float)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"communicator mode {mode!r} is not one of {MODES}")
        self.mode = mode

    def reset(self) -> dict[str, float]:
        """The exposed seconds per op since the last reset (and start counting afresh)."""
        out, self.exposed_s = dict(self.exposed_s), defaultdict(float)
        return out

    def _run(self, op: str, post, async_op: bool, skip_result=None, tensors=()):
        if self.mode == "skip" and skip_result is not None and all(t.is_floating_point() for t in tensors):
            skip_result()
            return DoneHandle() if async_op else None
        with _Span(self, op):
            handle = post(async_op or self.mode == "serial")
            if self.mode == "serial" and handle is not None:
                handle.wait()
                handle = DoneHandle() if async_op else None
        return _TimedHandle(self, op, handle) if handle is not None else None

    # -- collectives: skipped ones leave right-shaped, wrong values -----------------------------
    def all_reduce(self, tensor, op="sum", async_op=False):
        return self._run(
            "all_reduce", lambda a: self.inner.all_reduce(tensor, op, a), async_op, lambda: None, (tensor,)
        )

    def all_gather(self, output, input, async_op=False):
        def fake():
            output.view(self.size, -1).copy_(input.reshape(1, -1).expand(self.size, -1))

        return self._run("all_gather", lambda a: self.inner.all_gather(output, input, a), async_op, fake, (output,))

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        def fake():
            output.view(-1).copy_(input.reshape(self.size, -1)[self.rank])

        return self._run(
            "reduce_scatter", lambda a: self.inner.reduce_scatter(output, input, op, a), async_op, fake, (output,)
        )

    def all_to_all(self, output, input, output_splits=None, input_splits=None, async_op=False):
        return self._run(
            "all_to_all", lambda a: self.inner.all_to_all(output, input, output_splits, input_splits, a), async_op
        )  # never skipped: MoE routing sizes travel this way

    def broadcast(self, tensor, src=0, async_op=False):
        return self._run("broadcast", lambda a: self.inner.broadcast(tensor, src, a), async_op)

    # -- point to point ---------------------------------------------------------------------------
    def isend(self, tensor, dst, tag=0):
        return self._run("send", lambda a: self.inner.isend(tensor, dst, tag), True, lambda: None, (tensor,))

    # A skipped receive leaves zeros, not whatever memory held: garbage floats can be denormals
    # or NaNs, which slow the arithmetic and would bias the lower bound.
    def irecv(self, tensor, src, tag=0):
        return self._run("recv", lambda a: self.inner.irecv(tensor, src, tag), True, tensor.zero_, (tensor,))

    def batch_isend_irecv(self, ops):
        def fake():
            for o in ops:
                if o.kind == "recv":
                    o.tensor.zero_()

        return self._run("send_recv", lambda a: self.inner.batch_isend_irecv(ops), True, fake, [o.tensor for o in ops])

"""A communicator that can pretend its collectives are free, for measuring what they cost.

`dist-infer bench --overlap-report` runs the same workload with the tensor-parallel
collectives skipped: the output is wrong, but the time is the lower bound that overlap can
approach, which turns "how much communication did we hide" into a number.
"""

from __future__ import annotations

from dist_infer.comm.base import Communicator, DoneHandle


class SkippableCommunicator(Communicator):
    """Delegates to `inner`; while `skip` is True, all_reduce / all_gather / reduce_scatter do nothing."""

    def __init__(self, inner: Communicator):
        super().__init__(inner.rank, inner.ranks, inner.name, inner.timeout)
        self.inner, self.backend, self.skip = inner, inner.backend, False

    def _done(self, async_op: bool):
        return DoneHandle() if async_op else None

    def all_reduce(self, tensor, op="sum", async_op=False):
        return self._done(async_op) if self.skip else self.inner.all_reduce(tensor, op, async_op)

    def all_gather(self, output, input, async_op=False):
        if self.skip:
            output.view(self.size, -1).copy_(input.reshape(1, -1).expand(self.size, -1))  # shape-correct, wrong values
            return self._done(async_op)
        return self.inner.all_gather(output, input, async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        if self.skip:
            output.view(-1).copy_(input.reshape(self.size, -1)[self.rank])
            return self._done(async_op)
        return self.inner.reduce_scatter(output, input, op, async_op)

    # everything else is the inner communicator's
    def all_to_all(self, *a, **k):
        return self.inner.all_to_all(*a, **k)

    def broadcast(self, *a, **k):
        return self.inner.broadcast(*a, **k)

    def barrier(self, *a, **k):
        return self.inner.barrier(*a, **k)

    def isend(self, *a, **k):
        return self.inner.isend(*a, **k)

    def irecv(self, *a, **k):
        return self.inner.irecv(*a, **k)

    def batch_isend_irecv(self, ops):
        return self.inner.batch_isend_irecv(ops)

    def split(self, groups, name):
        return self.inner.split(groups, name)

    def destroy(self):
        self.inner.destroy()

    def _post_all_reduce(self, tensor, op):  # pragma: no cover - public methods delegate
        raise NotImplementedError

    _post_all_gather = _post_reduce_scatter = _post_all_to_all = _post_broadcast = _post_barrier = _post_p2p = _post_all_reduce

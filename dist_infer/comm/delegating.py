"""A communicator that wraps another and changes only some ops (shared-memory all-reduce,
skipped collectives for measurement); everything not overridden goes to the inner one."""

from __future__ import annotations

from dist_infer.comm.base import Communicator


class DelegatingCommunicator(Communicator):
    def __init__(self, inner: Communicator):
        super().__init__(inner.rank, inner.ranks, inner.name, inner.timeout)
        self.inner = inner
        self.backend = inner.backend

    def all_reduce(self, tensor, op="sum", async_op=False):
        return self.inner.all_reduce(tensor, op, async_op)

    def all_gather(self, output, input, async_op=False):
        return self.inner.all_gather(output, input, async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        return self.inner.reduce_scatter(output, input, op, async_op)

    def all_to_all(self, output, input, output_splits=None, input_splits=None, async_op=False):
        return self.inner.all_to_all(output, input, output_splits, input_splits, async_op)

    def broadcast(self, tensor, src=0, async_op=False):
        return self.inner.broadcast(tensor, src, async_op)

    def barrier(self, async_op=False):
        return self.inner.barrier(async_op)

    def isend(self, tensor, dst, tag=0):
        return self.inner.isend(tensor, dst, tag)

    def irecv(self, tensor, src, tag=0):
        return self.inner.irecv(tensor, src, tag)

    def batch_isend_irecv(self, ops):
        return self.inner.batch_isend_irecv(ops)

    def split(self, groups, name):
        return self.inner.split(groups, name)

    def destroy(self):
        self.inner.destroy()

    # The public methods above never reach the backend hooks.
    def _unused(self, *args, **kwargs):  # pragma: no cover
        raise AssertionError("DelegatingCommunicator posts through its inner communicator")

    _post_all_reduce = _post_all_gather = _post_reduce_scatter = _post_all_to_all = _unused
    _post_broadcast = _post_barrier = _post_p2p = _unused

"""A communicator that can pretend its collectives are free, for measuring what they cost.

`dist-infer bench --overlap-report` runs the same workload with the tensor-parallel
collectives skipped: the output is wrong, but the time is the lower bound that overlap can
approach, which turns "how much communication did we hide" into a number.
"""

from __future__ import annotations

from dist_infer.comm.base import DoneHandle
from dist_infer.comm.delegating import DelegatingCommunicator


class SkippableCommunicator(DelegatingCommunicator):
    """While `skip` is True, all_reduce / all_gather / reduce_scatter do no communication."""

    skip = False

    def _done(self, async_op: bool):
        return DoneHandle() if async_op else None

    def all_reduce(self, tensor, op="sum", async_op=False):
        return self._done(async_op) if self.skip else self.inner.all_reduce(tensor, op, async_op)

    def all_gather(self, output, input, async_op=False):
        if self.skip:
            output.view(self.size, -1).copy_(input.reshape(1, -1).expand(self.size, -1))  # right shape, wrong values
            return self._done(async_op)
        return self.inner.all_gather(output, input, async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        if self.skip:
            output.view(-1).copy_(input.reshape(self.size, -1)[self.rank])
            return self._done(async_op)
        return self.inner.reduce_scatter(output, input, op, async_op)

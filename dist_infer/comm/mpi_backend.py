"""Communicator over MPI through mpi4py.

CPU tensors go to MPI without copies through the buffer protocol (a numpy view of the same
memory). CUDA tensors go as they are when the MPI library is CUDA-aware, otherwise staged
through host memory. Every op is posted non-blocking (MPI-3 I* collectives) so it has a handle
that can be waited on with a timeout.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from dist_infer.comm.base import CommError, Communicator, Handle, P2POp, PollingHandle


def _mpi():
    from mpi4py import MPI

    return MPI


def cuda_aware() -> bool:
    """True when the MPI library says it can take device pointers."""
    MPI = _mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query else False
    except Exception:
        return False


# Reductions numpy can do in place; bf16 has no numpy type and is reduced in fp32.
_NUMPY_REDUCIBLE = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
}
# For pure data movement any dtype travels as raw bytes of the same width.
_BIT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Staged:
    """A host-side, MPI-compatible stand-in for a tensor, copied back when the op completes."""

    def __init__(self, tensor: torch.Tensor, reduce: bool, device_ok: bool):
        if not tensor.is_contiguous():
            raise CommError(
                f"MPI ops need contiguous tensors (got strides {tensor.stride()} for shape {tuple(tensor.shape)})"
            )
        self.orig = tensor
        work = tensor
        if tensor.is_cuda and not device_ok:
            work = tensor.detach().cpu()
        if reduce and work.dtype not in _NUMPY_REDUCIBLE:
            work = work.float()
        elif not reduce and work.dtype not in _NUMPY_REDUCIBLE:
            work = work.view(_BIT_VIEW[work.element_size()])
        self.work = work
        self.copy_back = work.data_ptr() != tensor.data_ptr()

    def buf(self):
        if self.work.is_cuda:
            torch.cuda.current_stream().synchronize()
            return self.work
        return self.work.numpy()

    def finish(self) -> None:
        if self.copy_back:
            work = self.work
            if work.dtype != self.orig.dtype and work.element_size() == self.orig.element_size():
                work = work.view(self.orig.dtype)
            self.orig.copy_(work.view_as(self.orig))


def _reduce_op(op: str):
    MPI = _mpi()
    return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]


class MPICommunicator(Communicator):
    backend = "mpi"

    def __init__(self, comm, ranks: Optional[Sequence[int]] = None, name: str = "world", timeout: float = 300.0):
        MPI = _mpi()
        self.comm = comm
        if ranks is None:
            ranks = (
                list(range(comm.Get_size())) if comm == MPI.COMM_WORLD else comm.allgather(MPI.COMM_WORLD.Get_rank())
            )
        super().__init__(comm.Get_rank(), ranks, name, timeout)
        self._device_ok = cuda_aware()

    def _stage(self, tensor: torch.Tensor, reduce: bool = False) -> _Staged:
        return _Staged(tensor, reduce, self._device_ok)

    def _handle(self, requests, op: str, staged: Sequence[_Staged] = ()) -> Handle:
        MPI = _mpi()
        reqs = requests if isinstance(requests, list) else [requests]

        def test() -> bool:
            return MPI.Request.Testall(reqs)

        def copy_back() -> None:
            for s in staged:
                s.finish()

        on_complete = copy_back if any(s.copy_back for s in staged) else None
        return PollingHandle(test, self.describe(op), self.timeout, on_complete)

    def _post_all_reduce(self, tensor, op):
        s = self._stage(tensor, reduce=True)
        req = self.comm.Iallreduce(_mpi().IN_PLACE, s.buf(), op=_reduce_op(op))
        return self._handle(req, "all_reduce", [s])

    def _post_all_gather(self, output, input):
        si, so = self._stage(input), self._stage(output)
        return self._handle(self.comm.Iallgather(si.buf(), so.buf()), "all_gather", [so])

    def _post_reduce_scatter(self, output, input, op):
        si, so = self._stage(input, reduce=True), self._stage(output, reduce=True)
        return self._handle(
            self.comm.Ireduce_scatter_block(si.buf(), so.buf(), op=_reduce_op(op)), "reduce_scatter", [so]
        )

    def _post_all_to_all(self, output, input, out_splits, in_splits):
        si, so = self._stage(input), self._stage(output)
        send_counts = [n * math.prod(input.shape[1:]) for n in in_splits]
        recv_counts = [n * math.prod(output.shape[1:]) for n in out_splits]
        send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(int).tolist()
        recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(int).tolist()
        req = self.comm.Ialltoallv([si.buf(), (send_counts, send_displs)], [so.buf(), (recv_counts, recv_displs)])
        return self._handle(req, "all_to_all", [so])

    def _post_broadcast(self, tensor, src):
        s = self._stage(tensor)
        if s.copy_back and self.rank == src:
            s.copy_back = False
        return self._handle(self.comm.Ibcast(s.buf(), root=src), "broadcast", [s])

    def _post_barrier(self):
        return self._handle(self.comm.Ibarrier(), "barrier")

    def _post_p2p(self, ops: list[P2POp]) -> Handle:
        reqs, staged = [], []
        for o in ops:
            s = self._stage(o.tensor)
            if o.kind == "send":
                reqs.append(self.comm.Isend(s.buf(), dest=o.peer, tag=o.tag))
            else:
                reqs.append(self.comm.Irecv(s.buf(), source=o.peer, tag=o.tag))
                staged.append(s)
        kinds = "+".join(sorted({o.kind for o in ops}))
        return self._handle(reqs, f"{kinds} with peers {sorted({o.peer for o in ops})}", staged)

    def split(self, groups, name):
        color, key = _mpi().UNDEFINED, self.rank
        for index, members in enumerate(groups):
            if self.rank in members:
                color, key = index, list(members).index(self.rank)
        sub = self.comm.Split(color, key)
        if color == _mpi().UNDEFINED:
            return None
        global_ranks = [self.ranks[r] for r in groups[color]]
        return MPICommunicator(sub, global_ranks, name, self.timeout)

    def destroy(self) -> None:
        MPI = _mpi()
        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.comm != MPI.COMM_NULL:
            try:
                self.comm.Free()
            except Exception:
                pass

"""Communicator over torch.distributed: NCCL for CUDA tensors, gloo for CPU tensors."""

from __future__ import annotations

import datetime
import threading
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from dist_infer.comm.base import CommError, CommTimeoutError, Communicator, Handle, P2POp

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}


class TorchWorkHandle(Handle):
    """A torch.distributed Work (or several) waited on with a timeout and a message naming the op."""

    def __init__(self, works, describe: str, timeout: float):
        self._works = works if isinstance(works, list) else [works]
        self._describe = describe
        self._timeout = timeout

    def wait(self, timeout: Optional[float] = None) -> None:
        limit = self._timeout if timeout is None else timeout
        for work in self._works:
            try:
                ok = work.wait(timeout=datetime.timedelta(seconds=limit))
            except RuntimeError as exc:
                text = str(exc)
                if "imed out" in text or "timeout" in text.lower():
                    raise CommTimeoutError(
                        f"{self._describe} did not complete within {limit:.0f} s: {text.splitlines()[0]}"
                    ) from exc
                raise CommError(
                    f"{self._describe} failed (is a peer rank dead?): {text.splitlines()[0] if text else exc!r}"
                ) from exc
            if ok is False:
                raise CommTimeoutError(f"{self._describe} did not complete within {limit:.0f} s")

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class WatchedWorkHandle(TorchWorkHandle):
    """gloo's send and receive Works only learn they are complete inside wait() (is_completed()
    stays False until someone waits), so polling them never succeeds. The first is_completed()
    starts a thread that waits; a wait() that comes first just waits, with no thread. Either way
    the Works are waited by one caller only (gloo's completion count is consumed by whoever
    waits), and the result is shared."""

    def __init__(self, works, describe: str, timeout: float):
        super().__init__(works, describe, timeout)
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._waiter = False  # someone (a thread, or a wait() call) waits on the Works

    def _claim(self) -> bool:
        with self._lock:
            first, self._waiter = not self._waiter, True
            return first

    def _wait_works(self, timeout: Optional[float] = None) -> None:
        try:
            super().wait(timeout)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc
        self._done.set()

    def wait(self, timeout: Optional[float] = None) -> None:
        limit = self._timeout if timeout is None else timeout
        if self._claim():
            self._wait_works(limit)
        elif not self._done.wait(limit):
            raise CommTimeoutError(f"{self._describe} did not complete within {limit:.0f} s")
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._claim():
            threading.Thread(target=self._wait_works, name="gloo-p2p-wait", daemon=True).start()
        return self._done.is_set()


def _contiguous(op: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous():
            raise CommError(f"{op}: tensors must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")


class TorchDistCommunicator(Communicator):
    """One torch.distributed process group. `group=None` is the world."""

    def __init__(self, group, ranks: Sequence[int], name: str = "world", timeout: float = 300.0):
        self.group = group
        my_global = dist.get_rank()
        super().__init__(list(ranks).index(my_global), ranks, name, timeout)
        self.backend = str(dist.get_backend(group))

    def _handle(self, works, op: str) -> Handle:
        return TorchWorkHandle(works, self.describe(op), self.timeout)

    def _post_all_reduce(self, tensor, op):
        return self._handle(dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True), "all_reduce")

    def _post_all_gather(self, output, input):
        _contiguous("all_gather", output, input)
        work = _all_gather_flat(output.view(-1), input.view(-1), group=self.group, async_op=True)
        return self._handle(work, "all_gather")

    def _post_reduce_scatter(self, output, input, op):
        _contiguous("reduce_scatter", output, input)
        work = _reduce_scatter_flat(output.view(-1), input.view(-1), op=_OPS[op], group=self.group, async_op=True)
        return self._handle(work, "reduce_scatter")

    def _post_all_to_all(self, output, input, out_splits, in_splits):
        _contiguous("all_to_all", output, input)
        work = dist.all_to_all_single(output, input, out_splits, in_splits, group=self.group, async_op=True)
        return self._handle(work, "all_to_all")

    def _post_broadcast(self, tensor, src):
        return self._handle(dist.broadcast(tensor, src=self.ranks[src], group=self.group, async_op=True), "broadcast")

    def _post_barrier(self):
        return self._handle(dist.barrier(group=self.group, async_op=True), "barrier")

    def _post_p2p(self, ops: list[P2POp]) -> Handle:
        _contiguous("send/recv", *(o.tensor for o in ops))
        p2p = [
            dist.P2POp(dist.isend if o.kind == "send" else dist.irecv, o.tensor, self.ranks[o.peer], self.group, o.tag)
            for o in ops
        ]
        works = (
            dist.batch_isend_irecv(p2p)
            if len(p2p) > 1
            else [
                (dist.isend if ops[0].kind == "send" else dist.irecv)(
                    ops[0].tensor, self.ranks[ops[0].peer], self.group, ops[0].tag
                )
            ]
        )
        kinds = "+".join(sorted({o.kind for o in ops}))
        describe = self.describe(f"{kinds} with peers {sorted({o.peer for o in ops})}")
        if self.backend == "gloo":
            return WatchedWorkHandle(list(works), describe, self.timeout)
        return TorchWorkHandle(list(works), describe, self.timeout)

    def split(self, groups, name):
        world = dist.get_world_size()
        mine = None
        timeout = datetime.timedelta(seconds=self.timeout)
        local_sync = self.size != world
        for members in groups:
            global_ranks = [self.ranks[r] for r in members]
            if local_sync and self.rank not in members:
                continue
            if len(global_ranks) == world and not local_sync:
                pg = None
            else:
                pg = dist.new_group(global_ranks, timeout=timeout, use_local_synchronization=local_sync)
            if self.rank in members:
                mine = TorchDistCommunicator(pg, global_ranks, name, self.timeout)
        return mine

    def destroy(self) -> None:
        if self.group is None and dist.is_initialized():
            dist.destroy_process_group()

"""All-reduce (and all-gather) through shared memory for groups whose ranks share a node (CPU tensors).

gloo moves even a 12 KB decode all-reduce through sockets and its own threads, twice per layer
(docs/benchmarks.md, "Collectives: `dist-infer comm-test` (gloo and MPI, 2 and 4 ranks)"). Ranks on
one node can instead write their partial sums into a shared segment and each add up everyone's: a
memcpy, a flag and a sum.

Protocol, per op with sequence number s, using buffer b = s % NBUF:
  post:  wait until every rank has finished reading buffer b's previous use (read flags),
         copy the tensor into this rank's slot of b, then publish write_flag[b][me] = s;
  wait:  spin until write_flag[b][r] == s for every r, sum the slots in rank order (so every
         rank gets bitwise the same result), then publish read_flag[b][me] = s.
Posting is cheap and the reduction happens at wait() (comm/partials.py).
Ordering relies on x86-64's total store order (stores are seen in program order), so the
segment is used only there; elsewhere, and for tensors that do not fit a slot, the inner
communicator does the work.
"""

from __future__ import annotations

import mmap
import os
import platform
import threading
import time
import uuid
from typing import NamedTuple, Optional

import numpy as np
import torch

from dist_infer.comm.base import CommError, CommTimeoutError, Communicator
from dist_infer.comm.partials import PartialsCommunicator, PartialsHandle, combine_partials
from dist_infer.comm.shm_sizes import DEFAULT_SLOT_BYTES, NBUF

SPIN_S = 2e-3  # how long a wait spins before it starts sleeping


def shm_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class _Segment(NamedTuple):
    """The views of the mapped segment (while any exists, the mapping cannot be closed)."""

    write_flags: np.ndarray  # [NBUF, ranks]: the op each rank last wrote into each buffer
    read_flags: np.ndarray  # [NBUF, ranks]: the op each rank last read out of each buffer
    data: torch.Tensor  # [NBUF, ranks, slot bytes]: the slots


class ShmAllReduceCommunicator(PartialsCommunicator):
    """`inner` with all_reduce(sum), all_gather and reduce_scatter of small CPU tensors done in a shared segment."""

    def __init__(self, inner: Communicator, slot_bytes: int = DEFAULT_SLOT_BYTES):
        super().__init__(inner)
        self.slot_bytes = self.max_bytes = slot_bytes
        n = self.size
        flag_bytes = 2 * NBUF * n * 8
        self._data_offset = -(-flag_bytes // 64) * 64
        total = self._data_offset + NBUF * n * slot_bytes
        self._mm = self._map_segment(total)
        flags = np.frombuffer(self._mm, dtype=np.int64, count=2 * NBUF * n).reshape(2, NBUF, n)
        data = torch.frombuffer(
            self._mm, dtype=torch.uint8, offset=self._data_offset, count=NBUF * n * slot_bytes
        ).view(NBUF, n, slot_bytes)
        self._segment: Optional[_Segment] = _Segment(flags[0], flags[1], data)  # None: closed
        self._seq = 0
        self._unfinished: dict[int, PartialsHandle] = {}  # my posted ops not yet reduced, by sequence number
        self._fence = threading.Lock()

    def _map_segment(self, total: int) -> mmap.mmap:
        """Rank 0 creates the file in /dev/shm, everyone maps it, then it is unlinked (no leak on a crash)."""
        name = torch.zeros(32, dtype=torch.uint8)
        path = None
        if self.rank == 0:
            token = uuid.uuid4().hex[:24]
            path = f"/dev/shm/dist_infer_{token}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, total)
            os.close(fd)
            name[: len(token)] = torch.tensor(list(token.encode()), dtype=torch.uint8)
        self.inner.broadcast(name, src=0)
        token = bytes(name.tolist()).rstrip(b"\0").decode()
        path = f"/dev/shm/dist_infer_{token}"
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.inner.barrier()
        if self.rank == 0:
            os.unlink(path)
        return mm

    def _views(self) -> _Segment:
        if self._segment is None:
            raise CommError(f"{self.describe('collective')}: its shared memory segment is closed")
        return self._segment

    def _spin(self, ready, what: str, timeout: float) -> None:
        """Spin, yielding the core on every turn, for up to SPIN_S (the peer is usually that
        close); then sleep with backoff so an oversubscribed node still runs the peer we wait for."""
        if ready():
            return
        start = time.monotonic()
        spin_until, deadline = start + SPIN_S, start + timeout
        pause = 1e-5
        while not ready():
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            if now > deadline:
                raise CommTimeoutError(f"{self.describe(what)} did not complete within {timeout:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)

    def _post(
        self, tensor: torch.Tensor, gather_into: Optional[torch.Tensor], scatter_into: Optional[torch.Tensor] = None
    ) -> PartialsHandle:
        """Publish `tensor` in this rank's slot; the handle sums the slots into it, concatenates
        them into `gather_into`, or sums this rank's chunk of them into `scatter_into`."""
        segment = self._views()
        self._seq += 1
        seq, b, me = self._seq, self._seq % NBUF, self.rank
        previous = seq - NBUF
        if previous in self._unfinished:  # my own op still holds this buffer: reduce it first
            self._unfinished[previous].wait()
        if previous > 0:
            reads = segment.read_flags[b]
            self._spin(lambda: bool((reads >= previous).all()), "all_reduce (shm buffer reuse)", self.timeout)
        nbytes = tensor.numel() * tensor.element_size()
        segment.data[b, me, :nbytes].copy_(tensor.view(-1).view(torch.uint8))
        with self._fence:  # a locked instruction: large copies may use streaming stores, TSO does not order those
            pass
        segment.write_flags[b, me] = seq
        handle = PartialsHandle(self, seq, tensor, gather_into, scatter_into)
        self._unfinished[seq] = handle
        return handle

    def _combine(
        self,
        seq: int,
        tensor: torch.Tensor,
        gather_into: Optional[torch.Tensor],
        timeout: float,
        scatter_into: Optional[torch.Tensor] = None,
    ) -> None:
        segment = self._views()
        b, me = seq % NBUF, self.rank
        writes = segment.write_flags[b]
        self._spin(lambda: bool((writes == seq).all()), "all_reduce (shm)", timeout)
        nbytes = tensor.numel() * tensor.element_size()
        slots = [segment.data[b, r, :nbytes].view(tensor.dtype) for r in range(self.size)]
        combine_partials(slots, me, tensor, gather_into, scatter_into)
        segment.read_flags[b, me] = seq
        self._unfinished.pop(seq, None)

    def close(self) -> None:
        """Unmap the segment (every view of it dropped first: a live one makes close() refuse);
        the inner communicator stays (it may be the world's)."""
        try:
            self._segment = None
            self._mm.close()
        except (BufferError, ValueError):
            pass

    def destroy(self) -> None:
        self.close()
        super().destroy()

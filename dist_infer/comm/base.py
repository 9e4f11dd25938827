"""The communicator interface every parallel layer talks to.

One object per process group. Every op works in place on caller-owned tensors (no hidden
allocation on the hot path) and has an async form (`async_op=True`) that returns a `Handle`
whose `wait()` blocks with a timeout, so layers can post communication and compute while it
flies. Group-local ranks everywhere (`src`, `dst` are positions in `ranks`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from dist_infer.comm.backends import DEFAULT_TIMEOUT_S

REDUCE_OPS = ("sum", "max", "min", "prod")


class CommError(RuntimeError):
    """A communication op failed or was misused; the message names the op and the group."""


class CommTimeoutError(CommError):
    """A wait ran out of time: a peer is dead, stuck or never posted the matching op."""


class Handle(ABC):
    """A posted operation. `wait` returns when it is complete or raises CommTimeoutError."""

    @abstractmethod
    def wait(self, timeout: Optional[float] = None) -> None: ...

    @abstractmethod
    def is_completed(self) -> bool: ...


class DoneHandle(Handle):
    """An op that completed when it was posted (size-1 groups, empty transfers)."""

    def wait(self, timeout: Optional[float] = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class PollingHandle(Handle):
    """Wait on a `test()` predicate with a deadline, spinning briefly then backing off to sleep.

    Spinning first keeps small-message latency low; sleeping later leaves the cores to the
    compute that the caller overlaps with communication (a CPU node may have only two).
    """

    def __init__(
        self, test: Callable[[], bool], describe: str, timeout: float, on_complete: Optional[Callable[[], None]] = None
    ):
        self._test = test
        self._describe = describe
        self._timeout = timeout
        self._on_complete = on_complete
        self._done = False

    def _finish(self) -> None:
        self._done = True
        if self._on_complete is not None:
            self._on_complete()
            self._on_complete = None

    def is_completed(self) -> bool:
        if not self._done and self._test():
            self._finish()
        return self._done

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._done:
            return
        limit = self._timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + limit
        spin_until = start + 2e-4
        pause = 1e-5
        while not self._test():
            now = time.monotonic()
            if now > deadline:
                raise CommTimeoutError(f"{self._describe} did not complete within {limit:.0f} s")
            if now > spin_until:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        self._finish()


@dataclass
class P2POp:
    """One send or receive of a batch; `peer` is a group rank."""

    kind: str  # "send" | "recv"
    tensor: torch.Tensor
    peer: int
    tag: int = 0

    def __post_init__(self):
        if self.kind not in ("send", "recv"):
            raise ValueError(f"P2POp kind must be 'send' or 'recv', got {self.kind!r}")


def _check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise CommError(f"unknown reduce op {op!r}; expected one of {REDUCE_OPS}")
    return op


class Communicator(ABC):
    """A process group: `size` ranks, this process being `rank` among them.

    Subclasses implement the `_post_*` methods, each posting the op and returning a Handle;
    this class validates shapes, short-circuits groups of one, and turns blocking calls into
    post + wait with the communicator's timeout.
    """

    backend: str = "?"

    def __init__(self, rank: int, ranks: Sequence[int], name: str = "world", timeout: float = DEFAULT_TIMEOUT_S):
        self.rank = rank
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.name = name
        self.timeout = float(timeout)

    # -- description -------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def describe(self, op: str) -> str:
        return (
            f"{op} on group {self.name!r} (ranks {list(self.ranks)}, backend {self.backend}, as group rank {self.rank})"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, rank={self.rank}, size={self.size}, ranks={list(self.ranks)})"
        )

    def _finish(self, handle: Handle, async_op: bool) -> Optional[Handle]:
        if async_op:
            return handle
        handle.wait(self.timeout)
        return None

    # -- collectives --------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Optional[Handle]:
        """Reduce `tensor` over the group, in place."""
        _check_op(op)
        if self.size == 1 or tensor.numel() == 0:
            return self._finish(DoneHandle(), async_op)
        return self._finish(self._post_all_reduce(tensor, op), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Optional[Handle]:
        """`output` (size x input rows along dim 0) receives every rank's `input`, in rank order."""
        if output.numel() != input.numel() * self.size or output.dtype != input.dtype:
            raise CommError(
                f"{self.describe('all_gather')}: output has {output.numel()} {output.dtype} elements, "
                f"needs {self.size} x {input.numel()} {input.dtype}"
            )
        if self.size == 1:
            output.view(-1).copy_(input.reshape(-1))
            return self._finish(DoneHandle(), async_op)
        return self._finish(self._post_all_gather(output, input), async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False
    ) -> Optional[Handle]:
        """`output` receives this rank's 1/size chunk (along dim 0) of the reduced `input`."""
        _check_op(op)
        if input.numel() != output.numel() * self.size or output.dtype != input.dtype:
            raise CommError(
                f"{self.describe('reduce_scatter')}: input has {input.numel()} {input.dtype} elements, "
                f"needs {self.size} x output's {output.numel()} {output.dtype}"
            )
        if self.size == 1:
            output.view(-1).copy_(input.reshape(-1))
            return self._finish(DoneHandle(), async_op)
        return self._finish(self._post_reduce_scatter(output, input, op), async_op)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Optional[Sequence[int]] = None,
        input_splits: Optional[Sequence[int]] = None,
        async_op: bool = False,
    ) -> Optional[Handle]:
        """Rank i sends rows `input_splits[j]` of `input` (dim 0) to rank j; splits may be unequal or 0.

        Without splits, dim 0 is cut into `size` equal parts.
        """
        in_splits = self._splits(input, input_splits, "input")
        out_splits = self._splits(output, output_splits, "output")
        if self.size == 1:
            output.copy_(input)
            return self._finish(DoneHandle(), async_op)
        return self._finish(self._post_all_to_all(output, input, out_splits, in_splits), async_op)

    def _splits(self, tensor: torch.Tensor, splits: Optional[Sequence[int]], which: str) -> list[int]:
        rows = tensor.shape[0] if tensor.dim() else 1
        if splits is None:
            if rows % self.size:
                raise CommError(
                    f"{self.describe('all_to_all')}: {which} has {rows} rows, not divisible by group size {self.size}; pass splits"
                )
            return [rows // self.size] * self.size
        splits = [int(s) for s in splits]
        if len(splits) != self.size or sum(splits) != rows or min(splits) < 0:
            raise CommError(
                f"{self.describe('all_to_all')}: {which} splits {splits} must be {self.size} non-negative "
                f"sizes summing to its {rows} rows"
            )
        return splits

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Optional[Handle]:
        """Every rank's `tensor` becomes group rank `src`'s."""
        self._check_peer(src, "broadcast")
        if self.size == 1:
            return self._finish(DoneHandle(), async_op)
        return self._finish(self._post_broadcast(tensor, src), async_op)

    def barrier(self, async_op: bool = False) -> Optional[Handle]:
        if self.size == 1:
            return self._finish(DoneHandle(), async_op)
        return self._finish(self._post_barrier(), async_op)

    # -- point to point -----------------------------------------------------------------
    def _check_peer(self, peer: int, op: str) -> None:
        if not 0 <= peer < self.size:
            raise CommError(f"{self.describe(op)}: peer {peer} is not a rank of this group of {self.size}")

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        self._check_peer(dst, "send")
        return self._post_p2p([P2POp("send", tensor, dst, tag)])

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        self._check_peer(src, "recv")
        return self._post_p2p([P2POp("recv", tensor, src, tag)])

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait(self.timeout)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait(self.timeout)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> Handle:
        """Post a batch of sends and receives together (a ring step, a pipeline exchange)."""
        for op in ops:
            self._check_peer(op.peer, op.kind)
        if not ops:
            return DoneHandle()
        if self.size == 1:
            return self._self_p2p(list(ops))
        return self._post_p2p(list(ops))

    def _self_p2p(self, ops: list[P2POp]) -> Handle:
        """A group of one exchanges with itself: each recv takes the first unmatched send of its tag."""
        sends = [o for o in ops if o.kind == "send"]
        for o in ops:
            if o.kind != "recv":
                continue
            i = next((i for i, s in enumerate(sends) if s.tag == o.tag), None)
            if i is None or sends[i].tensor.numel() != o.tensor.numel():
                raise CommError(
                    f"{self.describe('recv')}: no send of {o.tensor.numel()} elements with tag {o.tag} in the batch"
                )
            o.tensor.copy_(sends.pop(i).tensor.reshape(o.tensor.shape))
        if sends:
            raise CommError(f"{self.describe('send')}: {len(sends)} send(s) to self with no matching recv in the batch")
        return DoneHandle()

    # -- groups -------------------------------------------------------------------------
    @abstractmethod
    def split(self, groups: Sequence[Sequence[int]], name: str) -> Optional["Communicator"]:
        """Collective: make one sub-communicator per rank list (group ranks of this communicator).

        Every rank passes the same `groups`; each gets the one it belongs to (None if none).
        """

    def destroy(self) -> None:
        """Release the backend's resources (best effort, idempotent)."""

    # -- backend hooks ------------------------------------------------------------------
    @abstractmethod
    def _post_all_reduce(self, tensor: torch.Tensor, op: str) -> Handle: ...

    @abstractmethod
    def _post_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle: ...

    @abstractmethod
    def _post_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Handle: ...

    @abstractmethod
    def _post_all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Handle: ...

    @abstractmethod
    def _post_broadcast(self, tensor: torch.Tensor, src: int) -> Handle: ...

    @abstractmethod
    def _post_barrier(self) -> Handle: ...

    @abstractmethod
    def _post_p2p(self, ops: list[P2POp]) -> Handle: ...

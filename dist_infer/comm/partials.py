"""Small CPU collectives built from one primitive: post this rank's tensor to the group, and at
wait combine everyone's in rank order (shared memory: comm/shm.py; TCP links: comm/socket_links.py).

Posting only hands the bytes over, so an async op overlaps with whatever the caller computes
next without a helper thread competing for the cores; the combining happens at wait(). Every
rank adds the partials in the same order, so all hold bitwise the same sum. Anything these paths
do not take (device tensors, ops other than sum, tensors over `max_bytes`) goes to the inner
communicator.
"""

from __future__ import annotations

from typing import Optional

import torch

from dist_infer.comm.base import Handle
from dist_infer.comm.delegating import DelegatingCommunicator

SUMMABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def on_host(*tensors: torch.Tensor) -> bool:
    """These paths move host memory: device tensors (CUDA or any other) go to the inner backend."""
    return all(t.device.type == "cpu" for t in tensors)


def combine_partials(
    parts: list[torch.Tensor],
    me: int,
    tensor: torch.Tensor,
    gather_into: Optional[torch.Tensor],
    scatter_into: Optional[torch.Tensor],
) -> None:
    """Every rank's flat partial (`parts`, in rank order) into the op's result: their sum into
    `tensor`, their concatenation into `gather_into`, or the sum of rank `me`'s chunk into
    `scatter_into`. Sums run in rank order on every rank."""
    if gather_into is not None:
        torch.cat(parts, out=gather_into.view(-1))
        return
    if scatter_into is not None:
        n = scatter_into.numel()
        parts = [p[me * n : (me + 1) * n] for p in parts]
        flat = scatter_into.view(-1)
    else:
        flat = tensor.view(-1)
    torch.add(parts[0], parts[1], out=flat)
    for p in parts[2:]:
        flat.add_(p)


class PartialsHandle(Handle):
    def __init__(
        self,
        comm: "PartialsCommunicator",
        seq: int,
        tensor: torch.Tensor,
        gather_into: Optional[torch.Tensor],
        scatter_into: Optional[torch.Tensor] = None,
    ):
        self.comm, self.seq, self.tensor, self.gather_into, self.done = comm, seq, tensor, gather_into, False
        self.scatter_into = scatter_into

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: Optional[float] = None) -> None:
        if not self.done:
            limit = self.comm.timeout if timeout is None else timeout
            self.comm._combine(self.seq, self.tensor, self.gather_into, limit, self.scatter_into)
            self.done = True


class PartialsCommunicator(DelegatingCommunicator):
    """`inner`, with all_reduce(sum), all_gather and reduce_scatter(sum) of small CPU tensors
    done by `_post` (hand this rank's tensor over) and `_combine` (combine the group's)."""

    max_bytes: int = 0

    def all_gather(self, output, input, async_op=False):
        """Every rank's `input` into `output` (the LM head's logits, a cp decode's partials)."""
        nbytes = input.numel() * input.element_size()
        if (
            self.size == 1
            or input.numel() == 0
            or not on_host(input, output)
            or not input.is_contiguous()
            or not output.is_contiguous()
            or nbytes > self.max_bytes
            or output.numel() != input.numel() * self.size
            or output.dtype != input.dtype
        ):
            return self.inner.all_gather(output, input, async_op)
        return self._run(self._post(input, output), async_op)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        """Sum over the group of `input`, of which this rank keeps its chunk in `output` (the
        sequence-parallel layers): every rank posts its input, and adds up only its chunk."""
        if (
            self.size == 1
            or input.numel() == 0
            or not self._fits(input, op)
            or not on_host(output)
            or not output.is_contiguous()
            or output.numel() * self.size != input.numel()
        ):
            return self.inner.reduce_scatter(output, input, op, async_op)
        return self._run(self._post(input, None, output), async_op)

    def all_reduce(self, tensor, op="sum", async_op=False):
        if self.size == 1 or tensor.numel() == 0 or not self._fits(tensor, op):
            return self.inner.all_reduce(tensor, op, async_op)
        return self._run(self._post(tensor, None), async_op)

    def _fits(self, tensor: torch.Tensor, op: str) -> bool:
        return (
            op == "sum"
            and on_host(tensor)
            and tensor.is_contiguous()
            and tensor.dtype in SUMMABLE
            and tensor.numel() * tensor.element_size() <= self.max_bytes
        )

    @staticmethod
    def _run(handle: PartialsHandle, async_op: bool) -> Optional[PartialsHandle]:
        if async_op:
            return handle
        handle.wait()
        return None

    def _post(
        self, tensor: torch.Tensor, gather_into: Optional[torch.Tensor], scatter_into: Optional[torch.Tensor] = None
    ) -> PartialsHandle:
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what carries the small collectives; the inner communicator stays."""
        raise NotImplementedError

    def _combine(
        self,
        seq: int,
        tensor: torch.Tensor,
        gather_into: Optional[torch.Tensor],
        timeout: float,
        scatter_into: Optional[torch.Tensor] = None,
    ) -> None:
        raise NotImplementedError

"""Tensor-parallel communication, named for what it does to the tensor (Megatron's style)."""

from __future__ import annotations

import torch

from dist_infer.comm.base import Communicator


def reduce_from_tp(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """Sum the partial results of every tp rank, in place (the end of a row-parallel layer)."""
    tp.all_reduce(x)
    return x


def gather_from_tp(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """Concatenate every tp rank's shard along the last dimension (logits split by vocabulary)."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((tp.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    tp.all_gather(out, x)
    return out.movedim(0, -2).reshape(*x.shape[:-1], tp.size * x.shape[-1])

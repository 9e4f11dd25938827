"""Merging partial attention results by log-sum-exp.

Ring attention (and cp decode) computes attention over disjoint key sets separately; each
partial result is a normalised output O with its log-sum-exp L, and this module combines them
exactly (reference.md section 6), in one place so every caller merges the same stable way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_infer.comm.base import Communicator


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Merges run in fp32, or fp64 when the inputs are fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partials(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from each set's (O, LSE).

    o: [..., d], lse: [...]. The stable form O = O1 - sigmoid(L2 - L1) (O1 - O2) never
    exponentiates a large number; L = max + softplus(min - max) is L1 - logsigmoid(L1 - L2)
    written so that a very negative L1 does not cancel against L2. An empty set (L = -inf,
    O = 0) is the identity, and two empty sets give an empty set, never NaN.
    """
    dt = acc_dtype(o1.dtype)
    o, lse = o1.to(dt, copy=True), lse1.to(dt, copy=True)
    merge_into(o, lse, o2, lse2)
    return o, lse


def merge_into(acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """`merge_partials` of (acc_o, acc_lse) and (o, lse), written into acc_o and acc_lse in place
    (the ring's accumulators, or views of their rows): one temporary the size of `o`, where an
    out-of-place merge makes three and a copy back, most of the merge's peak memory. The
    accumulators must already be in the accumulation dtype (`acc_dtype`)."""
    dt = acc_o.dtype
    o, lse = o.to(dt), lse.to(dt)
    hi, lo = torch.maximum(acc_lse, lse), torch.minimum(acc_lse, lse)
    empty = torch.isneginf(hi)
    weight = torch.sigmoid(lse - acc_lse).masked_fill_(empty, 0.0)
    acc_o.sub_((acc_o - o).mul_(weight.unsqueeze(-1)))
    acc_lse.copy_(hi + F.softplus((lo - hi).masked_fill_(empty, 0.0)))


def merge_many(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge n partials at once: o [n, ..., d], lse [n, ...] -> ([..., d], [...]).

    L = logsumexp_i L_i and O = sum_i exp(L_i - L) O_i; every weight is <= 1, so nothing
    overflows, and rows where every partial is empty stay empty (O = 0, L = -inf).
    """
    dt = acc_dtype(o.dtype)
    o, lse = o.to(dt), lse.to(dt)
    total = torch.logsumexp(lse, dim=0)
    empty = torch.isneginf(total)
    weights = torch.exp(lse - total.masked_fill(empty, 0.0).unsqueeze(0))  # exp(-inf) = 0 for empty parts
    return (weights.unsqueeze(-1) * o).sum(0), total


def merge_across_ranks(o: torch.Tensor, lse: torch.Tensor, group: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank of `group` attended the same queries to its own keys: merge all partials.

    One all-gather of O and LSE packed together ([..., d + 1]), then `merge_many`; every rank
    gets the same result (decode over a KV cache sharded across cp ranks).
    """
    if group.size == 1:
        return o, lse
    dt = acc_dtype(o.dtype)
    packed = torch.cat([o.to(dt), lse.to(dt).unsqueeze(-1)], dim=-1).contiguous()
    gathered = torch.empty((group.size,) + tuple(packed.shape), dtype=dt, device=packed.device)
    group.all_gather(gathered, packed)
    return merge_many(gathered[..., :-1], gathered[..., -1])

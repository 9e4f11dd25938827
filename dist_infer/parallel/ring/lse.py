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


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from each set's (O, LSE).

    o: [..., d], lse: [...]. The stable form O = O1 - sigmoid(L2 - L1) (O1 - O2) never
    exponentiates a large number; L = max + softplus(min - max) is L1 - logsigmoid(L1 - L2)
    written so that a very negative L1 does not cancel against L2. An empty set (L = -inf,
    O = 0) is the identity, and two empty sets give an empty set, never NaN.
    """
    dt = acc_dtype(o1.dtype)
    o1, o2, lse1, lse2 = o1.to(dt), o2.to(dt), lse1.to(dt), lse2.to(dt)
    hi, lo = torch.maximum(lse1, lse2), torch.minimum(lse1, lse2)
    empty = torch.isneginf(hi)
    weight2 = torch.sigmoid(lse2 - lse1).masked_fill(empty, 0.0)  # sigmoid(+-inf) is exact 1 or 0
    o = o1 - weight2.unsqueeze(-1) * (o1 - o2)
    lse = hi + F.softplus((lo - hi).masked_fill(empty, 0.0))
    return o, lse


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

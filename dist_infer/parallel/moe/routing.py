"""Routing math for expert parallelism: which experts a token goes to, which tokens an ep rank
takes, and the order its rows are sent in.

Kept apart from the layer so it stays pure (tensors in, tensors out, no communicator, no state)
and is unit tested without processes.
"""

from __future__ import annotations

import torch


def topk_routing(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's and Qwen-MoE's router: softmax over all experts in fp32, then the top k.

    Returns (weights [n, k] fp32, expert ids [n, k]), ids in descending probability. With
    `renormalize` the k weights are divided by their sum (Mixtral always, Qwen by norm_topk_prob).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def token_chunk(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of part `index` when `total` tokens are cut into `parts` contiguous chunks.

    The first `total % parts` chunks get one token more; chunks may be empty (total < parts).
    """
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def dispatch_order(experts: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """The order in which a rank sends its (token, slot) pairs: by destination rank, then expert.

    `experts` [n, k] are expert ids, `owner` [E] the ep rank of each expert. Returns indices into
    the flattened [n*k] pairs. The receiver relies on this order: from each source it gets its
    experts' rows one expert after another, in ascending expert id.
    """
    flat = experts.reshape(-1)
    key = owner[flat] * owner.numel() + flat
    return torch.argsort(key, stable=True)

"""The small MoE the unit tests share: an HF config's common fields (each test adds its model_type
and expert counts), the shapes and seeded weights of one expert layer, and its reference: the
experts applied densely, token by token, from the full weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dist_infer.parallel.moe.routing import topk_routing

MOE_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    vocab_size=128,
    intermediate_size=96,
    num_experts_per_tok=2,
)

H, I, E, K = 16, 24, 8, 2  # hidden size, expert intermediate size, experts, experts per token


def expert_weights(seed=0):
    """Seeded router and expert weights of one layer: gate [E, H], w1 and w3 [E, I, H], w2 [E, H, I]."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(E, H, generator=gen),
        "w1": torch.randn(E, I, H, generator=gen) * 0.3,
        "w3": torch.randn(E, I, H, generator=gen) * 0.3,
        "w2": torch.randn(E, H, I, generator=gen) * 0.3,
    }


def dense_reference(x, w, renormalize=True):
    """Every token through its top-k experts, one at a time, from the full weights."""
    weights, experts = topk_routing(F.linear(x, w["gate"]), K, renormalize)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(experts[t, j])
            h = F.silu(w["w1"][e] @ x[t]) * (w["w3"][e] @ x[t])
            out[t] += weights[t, j] * (w["w2"][e] @ h)
    return out

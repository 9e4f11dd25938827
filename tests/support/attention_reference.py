"""Attention by the definition, in fp64: the reference ring attention's pieces are checked against."""

from __future__ import annotations

import torch


def exact_attention(q, k, v, q_pos, k_pos, causal, scale=None):
    """fp64 attention by the definition, masked by original positions: (O, LSE)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if causal:
        keep = torch.as_tensor(q_pos)[:, None] >= torch.as_tensor(k_pos)[None, :]
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v.double().repeat_interleave(g, 1))
    return out, lse.transpose(0, 1)

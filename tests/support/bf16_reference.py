"""The reference for bf16 prompts (`--prompt-dtype bfloat16`, models/fused_decode.py): a transformers
Llama whose prompt forward rounds what the native step rounds, in plain torch. Each decoder linear's
input and weight, and attention's queries, keys, probabilities and values, are rounded to bf16 and
multiplied in fp32 (what oneDNN's bf16 GEMM computes: bf16 inputs, fp32 accumulation and output);
norms, rotary, softmax, the residual stream and the LM head stay fp32, and the decode forwards
(one new token) are untouched fp32. Used with hf_reference, whose first forward is the prompt."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface


def bf16(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to bf16 (to nearest, ties to even), back in fp32."""
    return t.to(torch.bfloat16).to(torch.float32)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention of one unpadded sequence ([1, heads, q, d] against [1, kv_heads, k, d]), its
    products in bf16 where the forward is a prompt's (more than one query)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    rounded = bf16 if query.shape[2] > 1 else (lambda t: t)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = rounded(query) @ rounded(key).transpose(-1, -2) * scale
    q_len, k_len = query.shape[2], key.shape[2]
    sees = torch.arange(k_len)[None, :] <= torch.arange(k_len - q_len, k_len)[:, None]
    probs = torch.softmax(scores.masked_fill(~sees, float("-inf")), dim=-1)
    out = rounded(probs) @ rounded(value)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("dist_infer_bf16_prompt", _attention)


@contextlib.contextmanager
def bf16_prompt_products(model) -> Iterator[None]:
    """`model` (a transformers Llama) with its prompt forwards' products rounded as above, while
    the block runs."""
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    originals = [m.forward for m in linears]

    def rounding(module: torch.nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.shape[-2] == 1:  # a decode forward: fp32 as ever
                return F.linear(x, module.weight, module.bias)
            return F.linear(bf16(x), bf16(module.weight), module.bias)

        return forward

    implementation = model.config._attn_implementation
    for m in linears:
        m.forward = rounding(m)
    model.config._attn_implementation = "dist_infer_bf16_prompt"
    try:
        yield
    finally:
        model.config._attn_implementation = implementation
        for m, forward in zip(linears, originals):
            m.forward = forward

"""Attention of one block with its log-sum-exp, the unit of work of every ring step.

The merge needs each block's LSE, which plain SDPA does not return: this module picks the
kernel that does (torch's CPU flash op, flash-attn or torch's CUDA flash / efficient ops) and
keeps the explicit-score reference as the definition and the fallback.
"""

from __future__ import annotations

from typing import Optional

import torch

from dist_infer.parallel.ring.errors import RingAttentionError
from dist_infer.parallel.ring.lse import acc_dtype


def attention_with_lse_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores computed explicitly (fp32, or fp64 for fp64 inputs): the definition, and the fallback.

    q: [Tq, Hq, d], k/v: [Tk, Hkv, d] (Hq a multiple of Hkv, query head h reads kv head
    h // (Hq / Hkv)). Returns O [Tq, Hq, d] in q's dtype and LSE [Tq, Hq] in the accumulation
    dtype. causal: query i sees keys 0..i (top-left).
    """
    dt = acc_dtype(q.dtype)
    g = q.shape[1] // k.shape[1]
    kk = k.to(dt).repeat_interleave(g, dim=1)
    vv = v.to(dt).repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(dt), kk) * scale
    if causal:
        keep = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Tq]
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", probs, vv)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, d] -> [1, H, T, d] as a view (the SDPA ops take strided inputs)."""
    return x.transpose(0, 1).unsqueeze(0)


def _cpu_attention_with_lse(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads_first(q), _heads_first(k), _heads_first(v), 0.0, causal, scale=scale
    )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _expand_kv(k, v, q_heads):
    g = q_heads // k.shape[1]
    return (k, v) if g == 1 else (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))


def _cuda_attention_with_lse(q, k, v, causal, scale):
    """flash-attn when installed (GQA native), else torch's flash op (fp16/bf16) or efficient op.

    The flash kernels align a causal mask to the bottom right when there are fewer queries than
    keys; ours is top-left (query i sees keys 0..i), so such a block goes to the efficient op,
    whose causal mask is top-left (found on the first GPU run: docs/benchmarks.md, "The CUDA paths").
    """
    top_left_differs = causal and q.shape[0] != k.shape[0]
    if q.dtype in (torch.float16, torch.bfloat16) and not top_left_differs:
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None
        if flash_attn_func is not None:
            out, lse, _ = flash_attn_func(
                q.unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                softmax_scale=scale,
                causal=causal,
                return_attn_probs=True,
            )
            return out[0], lse[0].transpose(0, 1)
        k, v = _expand_kv(k, v, q.shape[1])
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _heads_first(q), _heads_first(k), _heads_first(v), 0.0, causal, False, scale=scale
        )
        return res[0][0].transpose(0, 1), res[1][0].transpose(0, 1)
    if q.dtype in (torch.float32, torch.float16, torch.bfloat16):
        k, v = _expand_kv(k, v, q.shape[1])
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            _heads_first(q).contiguous(),
            _heads_first(k).contiguous(),
            _heads_first(v).contiguous(),
            None,
            True,
            0.0,
            causal,
            scale=scale,
        )
        return res[0][0].transpose(0, 1), res[1][0, :, : q.shape[0]].transpose(0, 1)  # LSE rows padded to 32
    return attention_with_lse_reference(q, k, v, causal, scale)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: Optional[float] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention and its log-sum-exp: O [Tq, Hq, d], LSE [Tq, Hq] (natural log).

    CPU: torch's flash kernel for CPU, which returns the LSE (fp32 and fp64). CUDA: flash-attn
    or torch's flash / memory-efficient kernels. Both sides must be non-empty (the CPU kernel
    crashes on zero keys), which the block plan guarantees.
    """
    if q.shape[0] == 0 or k.shape[0] == 0:
        raise RingAttentionError(
            f"attention block with {q.shape[0]} queries and {k.shape[0]} keys: both must be non-empty"
        )
    if q.shape[1] % k.shape[1]:
        raise RingAttentionError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.is_cuda:
        o, lse = _cuda_attention_with_lse(q, k, v, causal, scale)
    elif q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        o, lse = _cpu_attention_with_lse(q, k, v, causal, scale)
    else:
        o, lse = attention_with_lse_reference(q, k, v, causal, scale)
    return o, lse.to(acc_dtype(q.dtype))

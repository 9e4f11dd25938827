"""Attention over a paged KV cache.

Each layer's cache is [num_blocks, block_size, kv_heads, head_dim]; a sequence's keys live in
the blocks its block table lists. The step's `AttentionMetadata` (attention_metadata.py) says
where the new keys go, how to pad queries into a batch, and the mask; this module computes the
attention from it, with torch's SDPA or the native CPU kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dist_infer.kernels import CpuKernels, kernels_if_cpu_fp32
from dist_infer.models.attention_metadata import AttentionMetadata


def _attend_in_parts(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels=None,
) -> torch.Tensor:
    """Attention of a mixed step, part by part; the cache already holds every new key and value.
    q: [T, heads, d], k/v: [T, kv_heads, d] -> [T, heads * d]."""
    T, heads, d = q.shape
    out = q.new_empty(T, heads * d)
    for rows, sub in meta.parts:
        if kernels is not None and sub.decode:
            out[rows] = kernels.decode_attention(
                q[rows].reshape(len(rows), heads * d),
                k_cache,
                v_cache,
                sub.block_tables,
                sub.seq_lens_t,
                sub.window,
                scale,
            )
        else:
            out[rows] = paged_attention(q[rows], k[rows], v[rows], k_cache, v_cache, sub, scale, written=True)
    return out


def _pad(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[T, heads, d] -> [B, max_q, heads, d]."""
    if meta.packed:
        return x.view(meta.batch, meta.max_q, *x.shape[1:])
    out = x.new_zeros(meta.batch * meta.max_q, *x.shape[1:])
    out[meta.pad_index] = x
    return out.view(meta.batch, meta.max_q, *x.shape[1:])


def native_kernels_for(
    q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, kernels: Optional[CpuKernels]
) -> Optional[CpuKernels]:
    """`kernels` if they serve this step (CPU, fp32, not context parallel), else None."""
    if meta.seq_lens_t is None or meta.cp is not None:
        return None
    return kernels_if_cpu_fp32(kernels, q, k_cache)


def attention_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels: Optional[CpuKernels],
) -> Optional[torch.Tensor]:
    """Rotary, cache write and attention with the native kernels -> [T, heads * d], or None where
    they do not apply (GPU, not fp32, no compiler): then the torch path runs.

    q, k, v: [T, heads * d] before rotary (column slices of the fused QKV output), rotated in
    place. A decode step (one token per sequence) attends in one native call over the paged
    cache: the torch path spends ~40 small ops per layer there (rotary, index_copy, gathering
    the blocks into a padded batch, masked SDPA), and on the CPU that per-op overhead, not
    arithmetic, was most of a decode step's attention time. Other steps keep torch's SDPA."""
    kernels = native_kernels_for(q, k_cache, meta, kernels)
    if kernels is None:
        return None
    if q.stride(1) != 1 or k.stride(1) != 1 or v.stride(1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kernels.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
    if meta.decode:
        return kernels.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t, meta.window, scale)
    T, d = q.shape[0], k_cache.shape[-1]
    if meta.parts is not None:
        return _attend_in_parts(
            q.view(T, -1, d), k.view(T, -1, d), v.view(T, -1, d), k_cache, v_cache, meta, scale, kernels
        )
    return paged_attention(
        q.view(T, -1, d), k.view(T, -1, d), v.view(T, -1, d), k_cache, v_cache, meta, scale, written=True
    )


def attention_gpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    q_heads: int,
    kernels,
) -> Optional[torch.Tensor]:
    """A decode step's rotary, cache write and attention on the GPU kernels (kernels/gpu) ->
    [B, heads * d], or None where they do not serve (not a plain decode step, not on their device).

    Two kernels a layer instead of the torch path's ~20: rotary with the cache write, then
    attention read from the cache blocks in place (no gathered copy). Nothing in them depends on
    the values of the step (its lengths are read on the device), so a CUDA graph can hold them."""
    if (
        kernels is None
        or not meta.decode
        or meta.cp is not None
        or meta.parts is not None
        or meta.seq_lens_t is None
        or not kernels.serves(q, k_cache)
    ):
        return None
    if q.stride(1) != 1 or k.stride(1) != 1 or v.stride(1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kernels.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, q_heads)
    rows, d = q.shape[0], k_cache.shape[-1]
    out = kernels.decode_attention(
        q.view(rows, q_heads, d), k_cache, v_cache, meta.block_tables, meta.seq_lens_t, scale, meta.window
    )
    return out.view(rows, q_heads * d)


def last_token_attention_native(
    q_last: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels: Optional[CpuKernels],
) -> Optional[torch.Tensor]:
    """Attention of each sequence's last new token only, every new key and value still cached:
    the model's last layer, whose other rows nobody reads. q_last [B, heads * d] (queries of
    rows meta.last_token_index), k, v [T, kv_heads * d]; returns [B, heads * d] or None."""
    kernels = native_kernels_for(q_last, k_cache, meta, kernels)
    if kernels is None or k.stride(1) != 1 or v.stride(1) != 1 or q_last.stride(1) != 1:
        return None
    kernels.rope_cache_write(None, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
    rows = meta.last_token_index
    kernels.rope_cache_write(q_last, None, None, cos[rows], sin[rows], k_cache, v_cache, None)
    return kernels.decode_attention(q_last, k_cache, v_cache, meta.block_tables, meta.seq_lens_t, meta.window, scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    written: bool = False,
) -> torch.Tensor:
    """q: [T, heads, d], k/v: [T, kv_heads, d] -> [T, heads * d]; writes k/v into the cache
    (unless `written`: the caller already did)."""
    kv_heads, d = k.shape[1], k.shape[2]
    if not written:
        k_cache.view(-1, kv_heads, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, d).index_copy_(0, meta.slot_mapping, v)
    if meta.parts is not None:
        return _attend_in_parts(q, k, v, k_cache, v_cache, meta, scale)
    if meta.fresh:
        keys, values = _pad(k, meta), _pad(v, meta)
    else:
        B = meta.batch
        blocks = meta.block_tables.view(-1)
        keys = k_cache.index_select(0, blocks).view(B, -1, kv_heads, d)[:, : meta.max_ctx]
        values = v_cache.index_select(0, blocks).view(B, -1, kv_heads, d)[:, : meta.max_ctx]
    queries = _pad(q, meta)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=meta.mask,
        is_causal=meta.mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != kv_heads,
    )  # [B, heads, max_q, d]
    out = out.transpose(1, 2).reshape(meta.batch * meta.max_q, -1)
    return out if meta.packed else out[meta.pad_index]

"""Decode attention over the paged KV cache, reading each block where it lies (flash-decoding).

One query token per sequence. The context is cut into fixed partitions of PARTITION tokens; a
program takes one (sequence, KV head, partition) and all the query heads that share that KV
head (GQA), streams its partition's keys and values in TILE-token tiles gathered through the
block table, and writes its partial output with its running max and sum. A second kernel merges
the partitions of each (sequence, head). Nothing is gathered into a contiguous copy first (the
torch path's `index_select` of every block, every layer).

The grid depends on the shapes only (the block table's width bounds the context), never on the
sequences' lengths: a partition past a sequence's end does no work and merges as weight 0, so a
step captured in a CUDA graph replays for any lengths, and an eager step with a narrower table
gives bitwise the same result (the partitions' bounds are the same).
"""

from __future__ import annotations

from typing import Optional

import torch

PARTITION = 64  # context tokens per program: at batch 1 a short context still spreads over many programs
TILE = 32  # tokens per inner step (>= 16: tl.dot's smallest side)
NO_WINDOW = 1 << 30  # the window of a model without one: longer than any context

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch reference serves
    triton = tl = None


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << (max(1, n) - 1).bit_length())


if triton is not None:

    @triton.jit
    def _decode_partition(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        seq_lens_ptr,
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        scale,
        window,
        num_parts,
        heads,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_tb,
        stride_sl,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_T: tl.constexpr,
        PART: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        part = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32)
        start = tl.maximum(seq_len - window, 0)  # window: NO_WINDOW when there is none
        lo = tl.maximum(part * PART, start)
        hi = tl.minimum(part * PART + PART, seq_len)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        head = kvh * GROUP + g
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(
            q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        s_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        t0 = lo
        while t0 < hi:  # a while, not range(lo, hi): Triton's interpreter cannot take loaded bounds there
            t = t0 + tl.arange(0, TILE_T)
            t_ok = t < hi
            block = tl.load(tables_ptr + b * stride_tb + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
            offset = t % BLOCK_SIZE
            kv_mask = t_ok[:, None] & d_ok[None, :]
            k = tl.load(
                k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(t_ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            s_sum = s_sum * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
            t0 += TILE_T
        row = (b * heads + head) * num_parts + part
        tl.store(part_max_ptr + row, m, mask=g_ok)
        tl.store(part_sum_ptr + row, s_sum, mask=g_ok)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_partitions(
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        out_ptr,
        seq_lens_ptr,
        window,
        num_parts,
        heads,
        stride_ob,
        stride_oh,
        stride_sl,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        PART: tl.constexpr,
    ):
        """The partitions a sequence used, merged one after another in order: the same sums, in the
        same order, whatever the grid's partition count (an eager step's narrower block table included)."""
        bh = tl.program_id(0)
        b = bh // heads
        h = bh % heads
        d = tl.arange(0, DIM_PAD)
        d_ok = d < HEAD_DIM
        seq_len = tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32)
        first = tl.maximum(seq_len - window, 0) // PART
        end = (seq_len + PART - 1) // PART
        base = bh * num_parts
        top = tl.load(part_max_ptr + base + first)
        p = first + 1
        while p < end:
            top = tl.maximum(top, tl.load(part_max_ptr + base + p))
            p += 1
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([DIM_PAD], tl.float32)
        p = first
        while p < end:
            w = tl.exp(tl.load(part_max_ptr + base + p) - top)
            total += tl.load(part_sum_ptr + base + p) * w
            acc += tl.load(part_out_ptr + (base + p) * HEAD_DIM + d, mask=d_ok, other=0.0) * w
            p += 1
        out = acc / total
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
) -> torch.Tensor:
    """q [B, heads, d] (one token per sequence; heads a multiple of the cache's KV heads), caches
    [num_blocks, block_size, kv_heads, d], block_tables [B, W], seq_lens [B] (the keys each query
    sees, its own included) -> [B, heads, d] in q's dtype. `window`: only the last `window` keys."""
    B, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    num_parts = max(1, -(-block_tables.shape[1] * block_size // PARTITION))
    part_out = torch.empty(B, heads, num_parts, dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(B, heads, num_parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    out = torch.empty_like(q)
    if B == 0:
        return out
    dim_pad = _pow2(dim, 16)
    _decode_partition[(B, kv_heads, num_parts)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_max,
        part_sum,
        scale,
        int(window or NO_WINDOW),
        num_parts,
        heads,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        seq_lens.stride(0),
        GROUP=group,
        GROUP_PAD=_pow2(group, 16),
        HEAD_DIM=dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        TILE_T=TILE,
        PART=PARTITION,
        IEEE=q.dtype == torch.float32,
    )
    _merge_partitions[(B * heads,)](
        part_out,
        part_max,
        part_sum,
        out,
        seq_lens,
        int(window or NO_WINDOW),
        num_parts,
        heads,
        out.stride(0),
        out.stride(1),
        seq_lens.stride(0),
        HEAD_DIM=dim,
        DIM_PAD=dim_pad,
        PART=PARTITION,
    )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
) -> torch.Tensor:
    """The same in plain torch, a sequence at a time in fp64 (the tests' truth)."""
    B, heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(B, heads, dim, dtype=torch.float64)
    for b in range(B):
        n = int(seq_lens[b])
        first = max(0, n - window) if window else 0
        slots = [int(block_tables[b, t // block_size]) * block_size + t % block_size for t in range(first, n)]
        keys = k_cache.reshape(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache.reshape(-1, kv_heads, dim)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), keys) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    return out

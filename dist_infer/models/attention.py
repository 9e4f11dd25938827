"""Attention over a paged KV cache.

Tokens of all sequences in a step travel flattened ([tokens, ...], vLLM's varlen layout). Each
layer's cache is [num_blocks, block_size, kv_heads, head_dim]; a sequence's keys live in the
blocks its block table lists. `AttentionMetadata` is computed once per step by the engine and
shared by every layer: where the new keys go (slot_mapping), how to pad queries into a batch,
and the mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F

from dist_infer.kernels import cpu_kernels_for

if TYPE_CHECKING:
    from dist_infer.models.cp_attention import ContextParallelMetadata


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of every new token
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of every new token
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context per sequence after this step, new tokens included
    block_tables: torch.Tensor  # [B, max_blocks] block ids (padding: 0, never read unmasked)
    pad_index: torch.Tensor  # [T] row of each token in the padded [B * max_q] query batch
    mask: Optional[torch.Tensor]  # [B, 1, max_q, max_ctx] True = may attend; None: plain causal
    last_token_index: torch.Tensor  # [B] index in [T] of each sequence's last new token
    max_q: int
    max_ctx: int
    fresh: bool  # no sequence has cached context: attend to the new keys directly
    cp: Optional["ContextParallelMetadata"] = None  # set when the sequence is sharded over cp ranks (cp_attention.py)
    seq_lens_t: Optional[torch.Tensor] = None  # seq_lens as a tensor, for the native decode kernel
    window: Optional[int] = None  # sliding window: a query sees the last `window` positions
    sequence_parallel: bool = False  # the step's tp layers run sequence parallel (parallel/sequence_parallel.py)
    # A mixed step (decodes beside prompt chunks, or prompts of different lengths) attends in parts:
    # (rows of the step's tokens, their own metadata). Padding every sequence to the longest
    # query would cost batch x longest chunk query rows: 60 decodes beside a 256-token chunk
    # would attend 15360 rows instead of 316.
    parts: Optional[list[tuple[torch.Tensor, "AttentionMetadata"]]] = None

    @property
    def decode(self) -> bool:
        """One new token per sequence: the step the native decode attention serves."""
        return self.max_q == 1

    @property
    def batch(self) -> int:
        return len(self.query_lens)

    @property
    def uniform(self) -> bool:
        return self.mask is None

    @property
    def packed(self) -> bool:
        """Every sequence has the same number of new tokens (every decode step): the flat tokens
        are already the [B, max_q] batch, no padding or gathering needed."""
        return self.pad_index.numel() == self.batch * self.max_q


def build_attention_metadata(query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                             block_size: int, sliding_window: Optional[int] = None) -> AttentionMetadata:
    """Everything a step's attention needs, from the sequences' lengths and block tables."""
    B = len(query_lens)
    max_q, max_ctx = max(query_lens), max(seq_lens)
    positions, slots, pad_index, last = [], [], [], []
    flat = 0
    for b, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        start = s - q
        for p in range(start, s):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        pad_index.extend(range(b * max_q, b * max_q + q))
        flat += q
        last.append(flat - 1)
    width = max(len(t) for t in block_tables)
    tables = torch.zeros(B, width, dtype=torch.long)
    for b, t in enumerate(block_tables):
        tables[b, : len(t)] = torch.tensor(t, dtype=torch.long)
    fresh = all(q == s for q, s in zip(query_lens, seq_lens))
    uniform = fresh and len(set(query_lens)) == 1 and (sliding_window is None or max_q <= sliding_window)
    mask = None
    if not uniform:
        q_pos = torch.tensor([s - q for q, s in zip(query_lens, seq_lens)])[:, None] + torch.arange(max_q)[None, :]
        k_pos = torch.arange(max_ctx)[None, None, :]
        mask = k_pos <= q_pos[:, :, None]
        if sliding_window is not None:
            mask &= k_pos > q_pos[:, :, None] - sliding_window
        padded_rows = torch.arange(max_q)[None, :] >= torch.tensor(query_lens)[:, None]
        mask[padded_rows] = False
        mask[..., 0] |= padded_rows  # padded query rows look at one key: no NaN, result discarded
        mask = mask.unsqueeze(1)
    parts = None
    if B > 1 and len(set(query_lens)) > 1:
        parts = _parts(query_lens, seq_lens, block_tables, block_size, sliding_window)
    return AttentionMetadata(
        parts=parts,
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_tables=tables,
        pad_index=torch.tensor(pad_index, dtype=torch.long),
        mask=mask,
        last_token_index=torch.tensor(last, dtype=torch.long),
        max_q=max_q,
        max_ctx=max_ctx,
        fresh=fresh,
        seq_lens_t=torch.tensor(list(seq_lens), dtype=torch.long),
        window=sliding_window,
    )


def _parts(query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
           block_size: int, sliding_window: Optional[int]) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """The decodes together (one packed batch), each longer query on its own."""
    starts = [sum(query_lens[:b]) for b in range(len(query_lens))]
    decodes = [b for b, q in enumerate(query_lens) if q == 1]
    groups = ([decodes] if decodes else []) + [[b] for b, q in enumerate(query_lens) if q > 1]
    out = []
    for g in groups:
        rows = torch.tensor([r for b in g for r in range(starts[b], starts[b] + query_lens[b])], dtype=torch.long)
        sub = build_attention_metadata([query_lens[b] for b in g], [seq_lens[b] for b in g],
                                       [block_tables[b] for b in g], block_size, sliding_window)
        out.append((rows, sub))
    return out


def _attend_in_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, kernels=None) -> torch.Tensor:
    """Attention of a mixed step, part by part; the cache already holds every new key and value.
    q: [T, heads, d], k/v: [T, kv_heads, d] -> [T, heads * d]."""
    T, heads, d = q.shape
    out = q.new_empty(T, heads * d)
    for rows, sub in meta.parts:
        if kernels is not None and sub.decode:
            out[rows] = kernels.decode_attention(q[rows].reshape(len(rows), heads * d), k_cache, v_cache,
                                                 sub.block_tables, sub.seq_lens_t, sub.max_ctx, sub.window, scale)
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


def native_kernels_for(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata):
    """The native CPU kernels if they serve this step (CPU, fp32, not context parallel), else None."""
    if meta.seq_lens_t is None or meta.cp is not None:
        return None
    return cpu_kernels_for(q, k_cache)


def attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> Optional[torch.Tensor]:
    """Rotary, cache write and attention with the native kernels -> [T, heads * d], or None where
    they do not apply (GPU, not fp32, no compiler): then the torch path runs.

    q, k, v: [T, heads * d] before rotary (column slices of the fused QKV output), rotated in
    place. A decode step (one token per sequence) attends in one native call over the paged
    cache: the torch path spends ~40 small ops per layer there (rotary, index_copy, gathering
    the blocks into a padded batch, masked SDPA), and on the CPU that per-op overhead, not
    arithmetic, was most of a decode step's attention time. Other steps keep torch's SDPA."""
    kernels = native_kernels_for(q, k_cache, meta)
    if kernels is None:
        return None
    if q.stride(1) != 1 or k.stride(1) != 1 or v.stride(1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kernels.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
    if meta.decode:
        return kernels.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t, meta.max_ctx,
                                        meta.window, scale)
    T, d = q.shape[0], k_cache.shape[-1]
    if meta.parts is not None:
        return _attend_in_parts(q.view(T, -1, d), k.view(T, -1, d), v.view(T, -1, d), k_cache, v_cache, meta, scale,
                                kernels)
    return paged_attention(q.view(T, -1, d), k.view(T, -1, d), v.view(T, -1, d), k_cache, v_cache, meta, scale,
                           written=True)


def last_token_attention_native(q_last: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                meta: AttentionMetadata, scale: float) -> Optional[torch.Tensor]:
    """Attention of each sequence's last new token only, every new key and value still cached:
    the model's last layer, whose other rows nobody reads. q_last [B, heads * d] (queries of
    rows meta.last_token_index), k, v [T, kv_heads * d]; returns [B, heads * d] or None."""
    kernels = native_kernels_for(q_last, k_cache, meta)
    if kernels is None or k.stride(1) != 1 or v.stride(1) != 1 or q_last.stride(1) != 1:
        return None
    kernels.rope_cache_write(None, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
    rows = meta.last_token_index
    kernels.rope_cache_write(q_last, None, None, cos[rows], sin[rows], k_cache, v_cache, None)
    return kernels.decode_attention(q_last, k_cache, v_cache, meta.block_tables, meta.seq_lens_t, meta.max_ctx,
                                    meta.window, scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, written: bool = False) -> torch.Tensor:
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
        queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=meta.mask, is_causal=meta.mask is None, scale=scale, enable_gqa=q.shape[1] != kv_heads,
    )  # [B, heads, max_q, d]
    out = out.transpose(1, 2).reshape(meta.batch * meta.max_q, -1)
    return out if meta.packed else out[meta.pad_index]


@dataclass
class TokenSplit:
    """A step's tokens cut in two halves that run interleaved (see parallel/token_split.py)."""

    a: AttentionMetadata
    b: AttentionMetadata
    cut: int  # tokens [0, cut) are half a
    full: AttentionMetadata  # the whole step, for layers that run unsplit (the trimmed last layer)


def split_token_halves(query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                       block_size: int, sliding_window: Optional[int] = None,
                       split_at: Optional[int] = None) -> TokenSplit:
    """Metadata for the two token halves of a step (TokenWeave's split).

    The flattened tokens are cut at `split_at` (default: the middle). A sequence that straddles
    the cut appears in both halves: the first half writes its keys to the cache, and the second
    half, which runs later in every layer, reads them from there like cached context.
    """
    total = sum(query_lens)
    if total < 2:
        raise ValueError(f"cannot split {total} token(s) into two halves")
    cut = total // 2 if split_at is None else split_at
    halves: list[tuple[list[int], list[int], list[list[int]]]] = [([], [], []), ([], [], [])]
    start = 0
    for q, s, table in zip(query_lens, seq_lens, block_tables):
        end = start + q
        first = max(0, min(end, cut) - start)  # this sequence's tokens before the cut
        if first:
            halves[0][0].append(first)
            halves[0][1].append(s - q + first)
            halves[0][2].append(list(table))
        if q - first:
            halves[1][0].append(q - first)
            halves[1][1].append(s)
            halves[1][2].append(list(table))
        start = end
    a, b = (build_attention_metadata(ql, sl, bt, block_size, sliding_window) for ql, sl, bt in halves)
    full = build_attention_metadata(query_lens, seq_lens, block_tables, block_size, sliding_window)
    return TokenSplit(a, b, cut, full)

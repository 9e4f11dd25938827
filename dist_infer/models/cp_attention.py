"""Attention with the sequence sharded over the context-parallel (cp) group.

Prefill: each cp rank holds its zigzag share of every prompt (its tokens, their original
positions, their KV-cache rows) and ring attention (parallel/ring/) computes the exact
causal attention across the ranks. Decode: every cp rank runs the new token (the same
on all of them), attends it to its own KV-cache shard, and the partial results are merged
across cp by log-sum-exp; the new token's K/V is stored on one rank only, round-robin, so the
shards stay even. No rank ever holds a whole sequence's keys and values.

The engine builds the metadata once per step (`cp_prefill_metadata`, `cp_decode_metadata`);
every layer then calls `cp_attention` with the cp communicator it was built with.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dist_infer.comm.base import Communicator
from dist_infer.kernels import CpuKernels, kernels_if_cpu_fp32
from dist_infer.models.attention_metadata import AttentionMetadata, ContextParallelMetadata
from dist_infer.parallel.ring.layout import RingLayout
from dist_infer.parallel.ring.local_attention import attention_with_lse
from dist_infer.parallel.ring.lse import merge_across_ranks
from dist_infer.parallel.ring.ring_loops import ring_attention
from dist_infer.parallel.ring.shards import zigzag_chunks
from dist_infer.parallel.ring.variant import HARDWARE_ESTIMATES, VARIANTS, choose_ring_variant

CP_VARIANTS = ("auto",) + VARIANTS


class ContextParallelError(ValueError):
    """A step the cp path cannot run; the message names the numbers."""


def _slot(table: Sequence[int], index: int, block_size: int) -> int:
    return table[index // block_size] * block_size + index % block_size


def cp_prefill_metadata(
    prompt_lens: Sequence[int],
    cp_size: int,
    cp_rank: int,
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    variant: str = "auto",
    q_heads: int = 1,
    kv_heads: int = 1,
    sliding_window: Optional[int] = None,
    device_type: str = "cpu",
    elem_bytes: int = 4,
) -> tuple[AttentionMetadata, list[list[int]]]:
    """Metadata for prefilling fresh prompts with their tokens zigzag-split over the cp ranks.

    Returns the metadata and, per sequence, the original positions this rank holds, in row
    order (the engine feeds those tokens). Local row i of a sequence goes to local cache slot
    i. `variant` "auto" asks `choose_ring_variant` with this rank's head counts and the device's
    estimated compute and link speed: with no cached context that is pass-KV, unless K/V are
    larger than Q (MHA) and the prompts too short for their transfer to hide.
    """
    if variant not in CP_VARIANTS:
        raise ContextParallelError(f"cp variant {variant!r} is not one of {CP_VARIANTS}")
    if sliding_window is not None and max(prompt_lens) > sliding_window:
        raise ContextParallelError(
            f"cp with a sliding window is not supported: a prompt of {max(prompt_lens)} tokens exceeds the "
            f"model's window of {sliding_window}"
        )
    shards = [zigzag_chunks(n, cp_size, cp_rank) for n in prompt_lens]
    layout = RingLayout.zigzag(prompt_lens, cp_size)
    if variant == "auto":
        flops, link = HARDWARE_ESTIMATES.get(device_type, HARDWARE_ESTIMATES["cpu"])
        chosen = choose_ring_variant(sum(prompt_lens), 0, q_heads, kv_heads, cp_size, flops, link, elem_bytes)
    else:
        chosen = variant
    mine = [list(s.positions) for s in shards]
    positions, slots, last_rows = [], [], []
    row = 0
    for n, pos, table in zip(prompt_lens, mine, block_tables):
        positions.extend(pos)
        slots.extend(_slot(table, i, block_size) for i in range(len(pos)))
        holds_last = bool(pos) and pos[-1] == n - 1  # the last token ends its shard
        last_rows.append(row + len(pos) - 1 if holds_last else -1)
        row += len(pos)
    local = [s.num_rows for s in shards]
    width = max(1, max(len(t) for t in block_tables))
    tables = torch.zeros(len(prompt_lens), width, dtype=torch.long)
    for b, t in enumerate(block_tables):
        tables[b, : len(t)] = torch.tensor(list(t), dtype=torch.long)
    cp = ContextParallelMetadata(
        "prefill",
        chosen,
        layout,
        layout.steps(cp_rank, chosen, causal=True),
        None,
        torch.tensor(last_rows, dtype=torch.long),
    )
    meta = AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_lens=local,
        seq_lens=local,
        block_tables=tables,
        pad_index=torch.arange(row),
        mask=None,
        last_token_index=torch.tensor(last_rows, dtype=torch.long).clamp(min=0),
        max_q=max(local),
        max_ctx=max(local),
        fresh=True,
        cp=cp,
    )
    return meta, mine


def cp_decode_owner(position: int, prompt_len: int, cp_size: int) -> int:
    """The cp rank that stores the KV of the token at `position` generated after a `prompt_len` prompt.

    Round-robin over the decode steps (step t on rank t % cp), so every shard grows evenly.
    """
    return (position - prompt_len) % cp_size


def cp_decode_metadata(
    positions: Sequence[int],
    store: Sequence[bool],
    local_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
) -> AttentionMetadata:
    """One new token per sequence, run on every cp rank.

    `store[b]`: this rank keeps sequence b's new K/V (it is then the last of its shard);
    `local_lens[b]`: keys of sequence b in this rank's shard after the step (may be 0).
    """
    B = len(positions)
    slots, rows = [], []
    for b in range(B):
        if store[b]:
            rows.append(b)
            slots.append(_slot(block_tables[b], local_lens[b] - 1, block_size))
    width = max(1, max(len(t) for t in block_tables))
    tables = torch.zeros(B, width, dtype=torch.long)
    for b, t in enumerate(block_tables):
        tables[b, : len(t)] = torch.tensor(list(t), dtype=torch.long)
    cp = ContextParallelMetadata("decode", "", None, None, torch.tensor(rows, dtype=torch.long), torch.arange(B))
    return AttentionMetadata(
        positions=torch.tensor(list(positions), dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_lens=[1] * B,
        seq_lens=list(local_lens),
        block_tables=tables,
        pad_index=torch.arange(B),
        mask=None,
        last_token_index=torch.arange(B),
        max_q=1,
        max_ctx=max(local_lens) if B else 0,
        fresh=False,
        cp=cp,
        seq_lens_t=torch.tensor(list(local_lens), dtype=torch.long),  # moves with the metadata: the shard's mask
    )


def shard_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    local_lens: Sequence[int],
    scale: float,
    kernels: Optional[CpuKernels] = None,
    local_lens_t: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence against this rank's shard only: (O [B, Hq, d], LSE [B, Hq]), fp32.

    A sequence with no key on this rank gives O = 0, LSE = -inf: the identity of the merge.
    With the native kernels (CPU, fp32) one call reads the shard through the block table; the
    torch path gathers the blocks into a padded batch first, which made a cp=2 decode step slower.
    `local_lens_t`: the same lengths as a tensor on q's device, if the caller has them there (the
    step's metadata does), so no layer copies them from the host again.
    """
    B, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    longest = max(local_lens) if B else 0
    if longest == 0:
        return (
            torch.zeros(B, heads, d, dtype=acc, device=q.device),
            torch.full((B, heads), float("-inf"), dtype=acc, device=q.device),
        )
    lens = (
        local_lens_t if local_lens_t is not None else torch.tensor(list(local_lens), dtype=torch.long, device=q.device)
    )
    kernels = kernels_if_cpu_fp32(kernels, q, k_cache)
    if kernels is not None:  # a CPU model: `lens` is a host int64 tensor
        lse = torch.empty(B, heads, dtype=torch.float32)
        out = kernels.decode_attention(
            q.reshape(B, heads * d), k_cache, v_cache, block_tables.contiguous(), lens, None, scale, lse
        )
        return out.view(B, heads, d), lse
    keys = k_cache[block_tables].view(B, -1, kv_heads, d)[:, :longest].to(acc)
    values = v_cache[block_tables].view(B, -1, kv_heads, d)[:, :longest].to(acc)
    g = heads // kv_heads
    scores = torch.einsum("bkgd,blkd->bkgl", q.view(B, kv_heads, g, d).to(acc), keys) * scale
    valid = torch.arange(longest, device=q.device)[None, :] < lens[:, None]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    out = torch.einsum("bkgl,blkd->bkgd", probs, values)
    return out.reshape(B, heads, d), lse.reshape(B, heads)


def _store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """This rank's new K/V rows into their cache slots (cp keeps each row on one rank only)."""
    if slot_mapping.numel():
        k_cache.view(-1, k.shape[1], k.shape[2]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, v.shape[1], v.shape[2]).index_copy_(0, slot_mapping, v)


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    cp: Communicator,
    kernels: Optional[CpuKernels] = None,
) -> torch.Tensor:
    """q: [T, heads, d], k/v: [T, kv_heads, d] of this rank's rows -> [T, heads * d]; stores this rank's K/V."""
    info = meta.cp
    if info.store_rows is None:
        _store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        _store_kv(k[info.store_rows], v[info.store_rows], k_cache, v_cache, meta.slot_mapping)
    if info.phase == "prefill":
        out, _ = ring_attention(q, k, v, cp, info.layout, info.variant, causal=True, scale=scale, steps=info.steps)
    else:
        partial, lse = shard_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, kernels, meta.seq_lens_t
        )
        out, _ = merge_across_ranks(partial, lse, cp)
    return out.to(q.dtype).reshape(q.shape[0], -1)


def cp_last_token_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    cp: Communicator,
) -> torch.Tensor:
    """The model's last layer in a cp prefill: stores this rank's K/V, but attends only each
    sequence's last token, the one row the LM head reads ([B, heads * d], the same on every
    rank). That query lives on one rank: a sum over cp gives it to all (the others add zeros);
    each rank attends it to its own rows of the sequence, all of which precede it, and the
    partials are merged by log-sum-exp. One query row instead of a ring pass over the whole
    prompt: the single-process path skips that work too, so cp must not pay for it."""
    info = meta.cp
    d = k.shape[2]
    _store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    B, heads = info.last_rows.numel(), q.shape[1]
    last_q = _rows_held_here(q, info.last_rows)
    cp.all_reduce(last_q)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(B, heads, d, dtype=acc, device=q.device)
    lse = torch.full((B, heads), float("-inf"), dtype=acc, device=q.device)
    start = 0
    for b, n in enumerate(meta.query_lens):  # this rank's rows of sequence b
        if n:
            o_b, lse_b = attention_with_lse(last_q[b : b + 1], k[start : start + n], v[start : start + n], False, scale)
            out[b], lse[b] = o_b[0].to(acc), lse_b[0]
        start += n
    merged, _ = merge_across_ranks(out, lse, cp)
    return merged.to(q.dtype).reshape(B, -1)


def cp_last_hidden(x: torch.Tensor, meta: AttentionMetadata, cp: Communicator) -> torch.Tensor:
    """Each sequence's last-token hidden state on every cp rank ([B, hidden]).

    After a prefill only one rank holds a sequence's last token: it contributes that row, the
    others zeros, and a sum over cp (exact: the other terms are zero) gives it to all, so all
    cp ranks compute the same logits and sample the same token.
    """
    info = meta.cp
    if info.phase == "decode":
        return x[meta.last_token_index]
    out = _rows_held_here(x, info.last_rows)
    cp.all_reduce(out)
    return out


def _rows_held_here(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows[b]] where rows[b] >= 0, zeros where another rank holds the row (-1): [B, ...].
    Selected without a boolean mask, whose result's size would need a device read."""
    if x.shape[0] == 0:  # this rank holds no row at all
        return x.new_zeros(rows.numel(), *x.shape[1:])
    held = (rows >= 0).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(held, x[rows.clamp(min=0)], 0.0).contiguous()

"""The ring loops: send/recv round the cp group while each step's blocks are attended.

Pass-KV moves the keys/values, pass-Q the queries (then returns the partials to their owner
with one all-to-all); both overlap the next step's transfer with this step's compute and merge
the blocks' results by log-sum-exp. No rank ever holds the whole sequence's K/V. The cp
communicator is passed explicitly.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional, Sequence

import torch
from torch.autograd.profiler import record_function

from dist_infer.comm.base import Communicator, P2POp
from dist_infer.parallel.ring.blocks import Block
from dist_infer.parallel.ring.errors import RingAttentionError
from dist_infer.parallel.ring.layout import RingLayout
from dist_infer.parallel.ring.local_attention import attention_with_lse
from dist_infer.parallel.ring.lse import acc_dtype, merge_into, merge_many
from dist_infer.parallel.ring.variant import VARIANTS

TAG_RING = 41  # ring transfers on the cp group; nothing else there uses point-to-point


RING_RANGE = "dist_infer::ring::step"  # profiler ranges: f"{RING_RANGE}{i}.{part}" (`bench --profile` sums them)


def _span(step: int, part: str):
    """A named range per ring step and part (post, attend, merge, wait) while a profiler runs; nothing otherwise."""
    return record_function(f"{RING_RANGE}{step}.{part}") if torch._C._autograd._profiler_enabled() else nullcontext()


def _attend_blocks(q, k, v, blocks: Sequence[Block], acc_o, acc_lse, scale, step: int = 0) -> None:
    """Attend each block and merge it into the accumulators' rows, in place."""
    for b in blocks:
        with _span(step, "attend"):
            o, lse = attention_with_lse(q[b.q0 : b.q1], k[b.k0 : b.k1], v[b.k0 : b.k1], b.causal, scale)
        with _span(step, "merge"):
            merge_into(acc_o[b.q0 : b.q1], acc_lse[b.q0 : b.q1], o, lse)


def _check(q, k, v, layout: RingLayout, group: Communicator) -> None:
    if layout.cp != group.size:
        raise RingAttentionError(f"ring layout is for {layout.cp} ranks, the cp group has {group.size}")
    me = group.rank
    if q.shape[0] != layout.q_rows[me] or k.shape[0] != layout.k_rows[me] or v.shape[:2] != k.shape[:2]:
        raise RingAttentionError(
            f"cp rank {me}: q has {q.shape[0]} rows, k {k.shape[0]}, v {v.shape[0]}; the layout says "
            f"{layout.q_rows[me]} query rows and {layout.k_rows[me]} key rows"
        )


def ring_attention_pass_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Communicator,
    layout: RingLayout,
    causal: bool = True,
    scale: Optional[float] = None,
    steps: Optional[list[list[Block]]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries to every rank's keys, the K/V travelling round the ring.

    q: [q_rows, Hq, d], k/v: [k_rows, Hkv, d] (only the KV heads travel under GQA). Step i
    holds rank (rank - i)'s K/V; the transfer for step i + 1 is posted before step i's
    compute (two buffers), so transfer and compute overlap. Returns (O in q's dtype,
    LSE [q_rows, Hq] fp32/fp64).
    """
    _check(q, k, v, layout, group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n, me = group.size, group.rank
    steps = layout.steps(me, "pass-kv", causal) if steps is None else steps
    acc_dt = acc_dtype(q.dtype)
    acc_o = torch.zeros(q.shape, dtype=acc_dt, device=q.device)
    acc_lse = torch.full(q.shape[:2], float("-inf"), dtype=acc_dt, device=q.device)
    rows = max(layout.k_rows)
    if n == 1 or rows == 0:  # nothing travels (every rank knows every rank's row count)
        _attend_blocks(q, k, v, steps[0], acc_o, acc_lse, scale)
        return acc_o.to(q.dtype), acc_lse
    bufs = [torch.empty((2, rows) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device) for _ in range(2)]
    bufs[0][0, : k.shape[0]] = k
    bufs[0][1, : k.shape[0]] = v
    nxt, prv = (me + 1) % n, (me - 1) % n
    for i in range(n):
        cur = bufs[i % 2]
        handle = None
        if i < n - 1:
            with _span(i, "post"):
                handle = group.batch_isend_irecv(
                    [P2POp("send", cur, nxt, TAG_RING), P2POp("recv", bufs[(i + 1) % 2], prv, TAG_RING)]
                )
        _attend_blocks(q, cur[0], cur[1], steps[i], acc_o, acc_lse, scale, i)
        if handle is not None:
            with _span(i, "wait"):
                handle.wait()
    return acc_o.to(q.dtype), acc_lse


def ring_attention_pass_q(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Communicator,
    layout: RingLayout,
    causal: bool = True,
    scale: Optional[float] = None,
    steps: Optional[list[list[Block]]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same attention with the queries travelling instead: K/V never leave their rank.

    Step i holds rank (rank - i)'s queries and attends them to the local K/V, the next
    queries' transfer posted before the compute. At the end one all-to-all returns every
    partial (O, LSE) to the queries' owner, which merges them. Cheaper than pass-KV when the
    new tokens are few next to the cached ones (see `choose_ring_variant`); the partials for
    every rank's queries wait here for that all-to-all, O(new tokens) memory per rank, which
    is small exactly when pass-Q is the right choice.
    """
    _check(q, k, v, layout, group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    n, me = group.size, group.rank
    steps = layout.steps(me, "pass-q", causal) if steps is None else steps
    acc_dt = acc_dtype(q.dtype)
    heads, d = q.shape[1], q.shape[2]
    # partial[s]: this rank's contribution to rank s's queries, packed as [rows_s, heads, d + 1] (O, LSE).
    partial = [torch.zeros(layout.q_rows[s], heads, d + 1, dtype=acc_dt, device=q.device) for s in range(n)]
    for p in partial:
        p[..., -1] = float("-inf")
    rows = max(layout.q_rows)
    if rows == 0:
        return q.new_zeros(q.shape), torch.full(q.shape[:2], float("-inf"), dtype=acc_dt, device=q.device)
    bufs = [torch.empty((rows, heads, d), dtype=q.dtype, device=q.device) for _ in range(2 if n > 1 else 1)]
    bufs[0][: q.shape[0]] = q
    nxt, prv = (me + 1) % n, (me - 1) % n
    for i in range(n):
        src = (me - i) % n
        cur = bufs[i % 2]
        handle = None
        if i < n - 1:
            with _span(i, "post"):
                handle = group.batch_isend_irecv(
                    [P2POp("send", cur, nxt, TAG_RING), P2POp("recv", bufs[(i + 1) % 2], prv, TAG_RING)]
                )
        acc_o, acc_lse = partial[src][..., :-1], partial[src][..., -1]
        _attend_blocks(cur, k, v, steps[i], acc_o, acc_lse, scale, i)
        if handle is not None:
            with _span(i, "wait"):
                handle.wait()
    if n == 1:
        return partial[0][..., :-1].to(q.dtype), partial[0][..., -1].clone()
    send = torch.cat(partial).contiguous()
    recv = torch.empty((n * layout.q_rows[me], heads, d + 1), dtype=acc_dt, device=q.device)
    group.all_to_all(recv, send, [layout.q_rows[me]] * n, list(layout.q_rows))
    recv = recv.view(n, layout.q_rows[me], heads, d + 1)
    o, lse = merge_many(recv[..., :-1], recv[..., -1])
    return o.to(q.dtype), lse


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Communicator,
    layout: RingLayout,
    variant: str = "pass-kv",
    causal: bool = True,
    scale: Optional[float] = None,
    steps: Optional[list[list[Block]]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ring_attention_pass_kv` or `ring_attention_pass_q` by name."""
    if variant == "pass-kv":
        return ring_attention_pass_kv(q, k, v, group, layout, causal, scale, steps)
    if variant == "pass-q":
        return ring_attention_pass_q(q, k, v, group, layout, causal, scale, steps)
    raise RingAttentionError(f"ring variant {variant!r} is not one of {VARIANTS}")

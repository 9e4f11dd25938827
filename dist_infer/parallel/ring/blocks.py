"""The block plan: which (query rows, key rows) blocks a rank computes at one ring step.

Causal masking is decided from original positions (the runs), never from row order; the plan
cuts each pair of runs into full blocks and square causal blocks so that every query sees
exactly its keys, whatever kernel attends them. Pure index arithmetic, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dist_infer.parallel.ring.shards import Run


@dataclass(frozen=True)
class Block:
    """Query rows [q0, q1) against key rows [k0, k1).

    causal=False: every query sees every key. causal=True: the block is square and both sides
    start at the same position, so query i sees keys 0..i (top-left and bottom-right causal
    alignment agree, so every kernel computes the same thing).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def _pair_blocks(q: Run, k: Run, causal: bool) -> list[Block]:
    """Blocks for one query run against one key run of the same sequence."""
    if not causal or k.stop - 1 <= q.start:  # every key at or before every query
        return [Block(q.row, q.row + q.length, k.row, k.row + k.length, False)]
    if k.start > q.stop - 1:  # every key after every query
        return []
    blocks = []
    # Queries before the first key see nothing; keys after the last query are seen by nothing.
    p0, p1 = max(q.start, k.start), min(q.stop, k.stop)  # the overlap: [p0, p1)
    q_row = q.row + (p0 - q.start)
    if p0 > k.start:  # keys [k.start, p0) precede every query from p0 on
        blocks.append(Block(q_row, q.row + q.length, k.row, k.row + (p0 - k.start), False))
    k_row = k.row + (p0 - k.start)
    n = p1 - p0
    blocks.append(Block(q_row, q_row + n, k_row, k_row + n, True))  # the diagonal square
    if q.stop > p1:  # queries after the last key see the overlap's keys fully
        blocks.append(Block(q_row + n, q.row + q.length, k_row, k_row + n, False))
    return blocks


def _coalesce(blocks: list[Block]) -> list[Block]:
    """Join full blocks that share key rows and touch in query rows (or the other way round)."""
    blocks = list(blocks)
    changed = True
    while changed:
        changed = False
        for i in range(len(blocks)):
            for j in range(len(blocks)):
                a, b = blocks[i], blocks[j]
                if i == j or a.causal or b.causal:
                    continue
                joined = None
                if (a.k0, a.k1) == (b.k0, b.k1) and a.q1 == b.q0:
                    joined = Block(a.q0, b.q1, a.k0, a.k1, False)
                elif (a.q0, a.q1) == (b.q0, b.q1) and a.k1 == b.k0:
                    joined = Block(a.q0, a.q1, a.k0, b.k1, False)
                if joined is not None:
                    blocks = [x for n, x in enumerate(blocks) if n not in (i, j)] + [joined]
                    changed = True
                    break
            if changed:
                break
    return sorted(blocks, key=lambda b: (b.q0, b.k0))


def plan_blocks(q_runs: Sequence[Run], k_runs: Sequence[Run], causal: bool = True) -> list[Block]:
    """Every (query rows, key rows) block to compute so that each query sees exactly its keys."""
    by_seq: dict[int, list[Block]] = {}
    for q in q_runs:
        for k in k_runs:
            if q.seq == k.seq and q.length and k.length:
                by_seq.setdefault(q.seq, []).extend(_pair_blocks(q, k, causal))
    return [b for seq in sorted(by_seq) for b in _coalesce(by_seq[seq])]  # sequences never share rows


def ring_step_flops(blocks: Sequence[Block], heads: int, head_dim: int) -> float:
    """Multiply-add FLOPs of one step's blocks (4 * d per visible query-key pair per head)."""
    pairs = 0
    for b in blocks:
        nq, nk = b.q1 - b.q0, b.k1 - b.k0
        pairs += nq * (nq + 1) // 2 if b.causal else nq * nk
    return 4.0 * head_dim * heads * pairs

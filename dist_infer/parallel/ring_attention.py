"""Exact ring attention: attention over a sequence sharded across the context-parallel group.

Each cp rank holds some rows of the sequence (queries, keys, values). The full attention is
computed block by block while either the keys/values (pass-KV) or the queries (pass-Q) travel
round the ring, and the partial results, each a normalised output O with its log-sum-exp L,
are merged exactly (reference.md section 6). No rank ever holds the whole sequence's K/V.

Which original positions a rank holds is described by `Run`s (rows holding consecutive
positions of one sequence), so the zigzag load-balanced split, a cached prefix, or several
sequences of a batch all go through one code path; causal masking is decided from original
positions, never from row order. The pure parts (merge, zigzag maps, block plan, variant
heuristic) are unit tested without processes; the ring functions take the cp communicator
explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from dist_infer.comm.base import Communicator, P2POp

VARIANTS = ("pass-kv", "pass-q")
TAG_RING = 41  # ring transfers on the cp group; nothing else there uses point-to-point
# (attention FLOP/s per rank, ring link bytes/s) for `choose_ring_variant` when the caller has no
# better numbers. cpu: measured on the 2-core CPU machine (torch's flash kernel on one thread,
# gloo point-to-point over loopback; docs/benchmarks.md). cuda: an H100 (989 TFLOP/s dense
# bf16) with 400 Gb/s InfiniBand per GPU, the Meta paper's setting.
HARDWARE_ESTIMATES = {"cpu": (6.5e10, 6e8), "cuda": (989e12, 50e9)}


class RingAttentionError(ValueError):
    """Inputs the ring cannot take; the message names the shapes and counts."""


# -- merging partial results ------------------------------------------------------------------

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Merges run in fp32, or fp64 when the inputs are fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets, from each set's (O, LSE).

    o: [..., d], lse: [...]. The stable form O = O1 - sigmoid(L2 - L1) (O1 - O2) never
    exponentiates a large number; L = max + softplus(min - max) is L1 - logsigmoid(L1 - L2)
    written so that a very negative L1 does not cancel against L2. An empty set (L = -inf,
    O = 0) is the identity, and two empty sets give an empty set, never NaN.
    """
    dt = _acc_dtype(o1.dtype)
    o1, o2, lse1, lse2 = o1.to(dt), o2.to(dt), lse1.to(dt), lse2.to(dt)
    hi, lo = torch.maximum(lse1, lse2), torch.minimum(lse1, lse2)
    empty = torch.isneginf(hi)
    weight2 = torch.sigmoid(lse2 - lse1).masked_fill(empty, 0.0)  # sigmoid(+-inf) is exact 1 or 0
    o = o1 - weight2.unsqueeze(-1) * (o1 - o2)
    lse = hi + F.softplus((lo - hi).masked_fill(empty, 0.0))
    return o, lse


def merge_many(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge n partials at once: o [n, ..., d], lse [n, ...] -> ([..., d], [...]).

    L = logsumexp_i L_i and O = sum_i exp(L_i - L) O_i; every weight is <= 1, so nothing
    overflows, and rows where every partial is empty stay empty (O = 0, L = -inf).
    """
    dt = _acc_dtype(o.dtype)
    o, lse = o.to(dt), lse.to(dt)
    total = torch.logsumexp(lse, dim=0)
    empty = torch.isneginf(total)
    weights = torch.exp(lse - total.masked_fill(empty, 0.0).unsqueeze(0))  # exp(-inf) = 0 for empty parts
    return (weights.unsqueeze(-1) * o).sum(0), total


def merge_across_ranks(o: torch.Tensor, lse: torch.Tensor, group: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank of `group` attended the same queries to its own keys: merge all partials.

    One all-gather of O and LSE packed together ([..., d + 1]), then `merge_many`; every rank
    gets the same result (decode over a KV cache sharded across cp ranks).
    """
    if group.size == 1:
        return o, lse
    dt = _acc_dtype(o.dtype)
    packed = torch.cat([o.to(dt), lse.to(dt).unsqueeze(-1)], dim=-1).contiguous()
    gathered = torch.empty((group.size,) + tuple(packed.shape), dtype=dt, device=packed.device)
    group.all_gather(gathered, packed)
    return merge_many(gathered[..., :-1], gathered[..., -1])


# -- which rows a rank holds -------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """Rows [row, row + length) of a rank's tensor hold positions [start, start + length) of sequence `seq`."""

    seq: int
    row: int
    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def runs_from_positions(positions: Sequence[int], seq: int = 0, row: int = 0) -> list[Run]:
    """Cut a row -> position map into runs of consecutive positions."""
    positions = [int(p) for p in positions]
    runs: list[Run] = []
    i = 0
    while i < len(positions):
        j = i + 1
        while j < len(positions) and positions[j] == positions[j - 1] + 1:
            j += 1
        runs.append(Run(seq, row + i, positions[i], j - i))
        i = j
    return runs


@dataclass(frozen=True)
class ZigzagShard:
    """Rank `rank`'s part of a `seq_len`-token sequence under causal load balancing.

    The sequence, padded to 2 * cp * chunk tokens, is cut into 2 * cp chunks; the rank holds
    chunks `rank` and 2 * cp - 1 - rank, so every rank has the same share of the causal
    triangle. Padding lies at the end of the sequence, so it is never stored: `positions`
    lists only the valid original positions, in local row order, and `padding` counts the
    rows this rank would hold in the padded sequence beyond seq_len.
    """

    seq_len: int
    cp: int
    rank: int
    chunk: int

    @property
    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.cp - 1 - self.rank

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The valid [start, stop) position range of each of the two chunks (possibly empty)."""
        return [(min(c * self.chunk, self.seq_len), min((c + 1) * self.chunk, self.seq_len)) for c in self.chunks]

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(p for start, stop in self.ranges for p in range(start, stop))

    @property
    def num_rows(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    @property
    def padding(self) -> int:
        return 2 * self.chunk - self.num_rows

    def runs(self, seq: int = 0, row: int = 0) -> list[Run]:
        """At most two runs, computed from the chunk bounds (no per-token work: prompts may be long)."""
        runs: list[Run] = []
        for start, stop in self.ranges:
            if stop <= start:
                continue
            if runs and runs[-1].stop == start:  # chunks cp - 1 and cp are adjacent
                last = runs.pop()
                runs.append(Run(seq, last.row, last.start, last.length + stop - start))
            else:
                runs.append(Run(seq, row, start, stop - start))
            row += stop - start
        return runs


def zigzag_chunks(seq_len: int, cp: int, rank: int) -> ZigzagShard:
    """The zigzag index map of `rank` among `cp` ranks for a sequence of `seq_len` tokens (any length)."""
    if cp < 1 or not 0 <= rank < cp:
        raise RingAttentionError(f"rank {rank} is not a rank of a cp group of {cp}")
    if seq_len < 0:
        raise RingAttentionError(f"sequence length {seq_len} is negative")
    return ZigzagShard(seq_len, cp, rank, -(-seq_len // (2 * cp)))


# -- the plan: which block of which rows each ring step computes -------------------------------

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


@dataclass(frozen=True)
class RingLayout:
    """Which rows every cp rank holds: its queries and its keys/values, as runs of positions.

    Each rank's tensors are [q_rows[r], heads, d] and [k_rows[r], kv_heads, d]; the counts may
    differ between ranks (the ring pads its transfer buffers to the largest).
    """

    q_runs: tuple[tuple[Run, ...], ...]
    k_runs: tuple[tuple[Run, ...], ...]
    q_rows: tuple[int, ...]
    k_rows: tuple[int, ...]

    @property
    def cp(self) -> int:
        return len(self.q_runs)

    @classmethod
    def from_positions(cls, q_positions: Sequence[Sequence[int]], k_positions: Sequence[Sequence[int]],
                       q_seqs: Optional[Sequence[Sequence[int]]] = None,
                       k_seqs: Optional[Sequence[Sequence[int]]] = None) -> "RingLayout":
        """From every rank's row -> position maps (and row -> sequence maps for a batch)."""
        if len(q_positions) != len(k_positions):
            raise RingAttentionError(f"{len(q_positions)} ranks of query positions but {len(k_positions)} of key positions")

        def runs(positions, seqs):
            positions = [int(p) for p in positions]
            seqs = [0] * len(positions) if seqs is None else [int(s) for s in seqs]
            out, start = [], 0
            for end in range(1, len(positions) + 1):
                if end == len(positions) or seqs[end] != seqs[start]:
                    out.extend(runs_from_positions(positions[start:end], seqs[start], start))
                    start = end
            return tuple(out)

        q_runs = tuple(runs(p, None if q_seqs is None else q_seqs[r]) for r, p in enumerate(q_positions))
        k_runs = tuple(runs(p, None if k_seqs is None else k_seqs[r]) for r, p in enumerate(k_positions))
        return cls(q_runs, k_runs, tuple(len(p) for p in q_positions), tuple(len(p) for p in k_positions))

    @classmethod
    def zigzag(cls, seq_lens: Sequence[int], cp: int) -> "RingLayout":
        """A batch of fresh sequences, each split zigzag; a rank's rows are its shards in batch order."""
        per_rank, rows = [], []
        for r in range(cp):
            runs, row = [], 0
            for seq, n in enumerate(seq_lens):
                shard = zigzag_chunks(n, cp, r)
                runs.extend(shard.runs(seq, row))
                row += shard.num_rows
            per_rank.append(tuple(runs))
            rows.append(row)
        return cls(tuple(per_rank), tuple(per_rank), tuple(rows), tuple(rows))

    @classmethod
    def gather(cls, group: Communicator, q_positions: torch.Tensor, k_positions: torch.Tensor,
               q_seqs: Optional[torch.Tensor] = None, k_seqs: Optional[torch.Tensor] = None) -> "RingLayout":
        """Collective: every rank passes only its own maps; one all-gather of counts, one of maps."""
        maps = [q_positions, k_positions,
                torch.zeros_like(q_positions) if q_seqs is None else q_seqs,
                torch.zeros_like(k_positions) if k_seqs is None else k_seqs]
        counts = torch.tensor([q_positions.numel(), k_positions.numel()], dtype=torch.long)
        all_counts = torch.empty(group.size, 2, dtype=torch.long)
        group.all_gather(all_counts, counts)
        width = max(1, int(all_counts.max()))
        mine = torch.full((4, width), -1, dtype=torch.long)
        for i, m in enumerate(maps):
            mine[i, : m.numel()] = m.reshape(-1).to(torch.long).cpu()
        everyone = torch.empty(group.size, 4, width, dtype=torch.long)
        group.all_gather(everyone, mine)
        qn, kn = all_counts[:, 0].tolist(), all_counts[:, 1].tolist()
        rows = everyone.tolist()
        return cls.from_positions([rows[r][0][: qn[r]] for r in range(group.size)],
                                  [rows[r][1][: kn[r]] for r in range(group.size)],
                                  [rows[r][2][: qn[r]] for r in range(group.size)],
                                  [rows[r][3][: kn[r]] for r in range(group.size)])

    def steps(self, rank: int, variant: str, causal: bool = True) -> list[list[Block]]:
        """The blocks `rank` computes at each ring step.

        pass-KV: at step i the rank holds rank (rank - i)'s keys and attends its own queries.
        pass-Q: at step i it holds rank (rank - i)'s queries and attends them to its own keys.
        """
        if variant not in VARIANTS:
            raise RingAttentionError(f"ring variant {variant!r} is not one of {VARIANTS}")
        n = self.cp
        out = []
        for i in range(n):
            src = (rank - i) % n
            if variant == "pass-kv":
                out.append(plan_blocks(self.q_runs[rank], self.k_runs[src], causal))
            else:
                out.append(plan_blocks(self.q_runs[src], self.k_runs[rank], causal))
        return out


def choose_ring_variant(new_tokens: int, cached_tokens: int, q_heads: int, kv_heads: int, cp: int = 1,
                        peak_flops: Optional[float] = None, link_bytes_per_s: Optional[float] = None,
                        elem_bytes: int = 2) -> str:
    """Pass-KV or pass-Q for one prefill, after the Meta context-parallelism paper.

    Pass-KV moves (new + cached) tokens x 2 x kv_heads per ring step, pass-Q moves new tokens x
    q_heads (and returns as many partial outputs at the end). Pass-KV wins when the new tokens'
    share of the context is at least 2 * kv_heads / q_heads (its transfer is no larger), or,
    given the hardware numbers, when its transfer hides behind each step's compute anyway:
    new tokens per rank >= C * e * kv_heads / (2 * q_heads * BW). Otherwise pass-Q.
    """
    if new_tokens < 0 or cached_tokens < 0 or q_heads < 1 or kv_heads < 1:
        raise RingAttentionError(f"bad counts: new {new_tokens}, cached {cached_tokens}, heads {q_heads}/{kv_heads}")
    total = new_tokens + cached_tokens
    if total == 0 or new_tokens / total >= 2 * kv_heads / q_heads:
        return "pass-kv"
    if peak_flops and link_bytes_per_s:
        hidden_from = peak_flops * elem_bytes * kv_heads / (2 * q_heads * link_bytes_per_s)
        if new_tokens / max(1, cp) >= hidden_from:
            return "pass-kv"
    return "pass-q"


# -- attention of one block, returning its log-sum-exp ----------------------------------------

def attention_with_lse_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores computed explicitly (fp32, or fp64 for fp64 inputs): the definition, and the fallback.

    q: [Tq, Hq, d], k/v: [Tk, Hkv, d] (Hq a multiple of Hkv, query head h reads kv head
    h // (Hq / Hkv)). Returns O [Tq, Hq, d] in q's dtype and LSE [Tq, Hq] in the accumulation
    dtype. causal: query i sees keys 0..i (top-left).
    """
    dt = _acc_dtype(q.dtype)
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
        _heads_first(q), _heads_first(k), _heads_first(v), 0.0, causal, scale=scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def _expand_kv(k, v, q_heads):
    g = q_heads // k.shape[1]
    return (k, v) if g == 1 else (k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1))


def _cuda_attention_with_lse(q, k, v, causal, scale):
    """flash-attn when installed (GQA native), else torch's flash op (fp16/bf16) or efficient op (fp32)."""
    if q.dtype in (torch.float16, torch.bfloat16):
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None
        if flash_attn_func is not None:
            out, lse, _ = flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=scale,
                                          causal=causal, return_attn_probs=True)
            return out[0], lse[0].transpose(0, 1)
        k, v = _expand_kv(k, v, q.shape[1])
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _heads_first(q), _heads_first(k), _heads_first(v), 0.0, causal, False, scale=scale)
        return res[0][0].transpose(0, 1), res[1][0].transpose(0, 1)
    if q.dtype == torch.float32:
        k, v = _expand_kv(k, v, q.shape[1])
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            _heads_first(q).contiguous(), _heads_first(k).contiguous(), _heads_first(v).contiguous(),
            None, True, 0.0, causal, scale=scale)
        return res[0][0].transpose(0, 1), res[1][0, :, : q.shape[0]].transpose(0, 1)  # LSE rows padded to 32
    return attention_with_lse_reference(q, k, v, causal, scale)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                       scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention and its log-sum-exp: O [Tq, Hq, d], LSE [Tq, Hq] (natural log).

    CPU: torch's flash kernel for CPU, which returns the LSE (fp32 and fp64). CUDA: flash-attn
    or torch's flash / memory-efficient kernels. Both sides must be non-empty (the CPU kernel
    crashes on zero keys), which the block plan guarantees.
    """
    if q.shape[0] == 0 or k.shape[0] == 0:
        raise RingAttentionError(f"attention block with {q.shape[0]} queries and {k.shape[0]} keys: both must be non-empty")
    if q.shape[1] % k.shape[1]:
        raise RingAttentionError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q.is_cuda:
        o, lse = _cuda_attention_with_lse(q, k, v, causal, scale)
    elif q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        o, lse = _cpu_attention_with_lse(q, k, v, causal, scale)
    else:
        o, lse = attention_with_lse_reference(q, k, v, causal, scale)
    return o, lse.to(_acc_dtype(q.dtype))


def _attend_blocks(q, k, v, blocks: Sequence[Block], acc_o, acc_lse, scale) -> None:
    """Attend each block and merge it into the accumulators' rows, in place."""
    for b in blocks:
        o, lse = attention_with_lse(q[b.q0:b.q1], k[b.k0:b.k1], v[b.k0:b.k1], b.causal, scale)
        merged_o, merged_lse = merge_partials(acc_o[b.q0:b.q1], acc_lse[b.q0:b.q1], o, lse)
        acc_o[b.q0:b.q1] = merged_o
        acc_lse[b.q0:b.q1] = merged_lse


def _check(q, k, v, layout: RingLayout, group: Communicator) -> None:
    if layout.cp != group.size:
        raise RingAttentionError(f"ring layout is for {layout.cp} ranks, the cp group has {group.size}")
    me = group.rank
    if q.shape[0] != layout.q_rows[me] or k.shape[0] != layout.k_rows[me] or v.shape[:2] != k.shape[:2]:
        raise RingAttentionError(
            f"cp rank {me}: q has {q.shape[0]} rows, k {k.shape[0]}, v {v.shape[0]}; the layout says "
            f"{layout.q_rows[me]} query rows and {layout.k_rows[me]} key rows")


# -- the ring ------------------------------------------------------------------------------------

def ring_attention_pass_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Communicator,
                           layout: RingLayout, causal: bool = True, scale: Optional[float] = None,
                           steps: Optional[list[list[Block]]] = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    acc_dt = _acc_dtype(q.dtype)
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
            handle = group.batch_isend_irecv([P2POp("send", cur, nxt, TAG_RING),
                                              P2POp("recv", bufs[(i + 1) % 2], prv, TAG_RING)])
        _attend_blocks(q, cur[0], cur[1], steps[i], acc_o, acc_lse, scale)
        if handle is not None:
            handle.wait()
    return acc_o.to(q.dtype), acc_lse


def ring_attention_pass_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Communicator,
                          layout: RingLayout, causal: bool = True, scale: Optional[float] = None,
                          steps: Optional[list[list[Block]]] = None) -> tuple[torch.Tensor, torch.Tensor]:
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
    acc_dt = _acc_dtype(q.dtype)
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
            handle = group.batch_isend_irecv([P2POp("send", cur, nxt, TAG_RING),
                                              P2POp("recv", bufs[(i + 1) % 2], prv, TAG_RING)])
        acc_o, acc_lse = partial[src][..., :-1], partial[src][..., -1]
        _attend_blocks(cur, k, v, steps[i], acc_o, acc_lse, scale)
        if handle is not None:
            handle.wait()
    if n == 1:
        return partial[0][..., :-1].to(q.dtype), partial[0][..., -1].clone()
    send = torch.cat(partial).contiguous()
    recv = torch.empty((n * layout.q_rows[me], heads, d + 1), dtype=acc_dt, device=q.device)
    group.all_to_all(recv, send, [layout.q_rows[me]] * n, list(layout.q_rows))
    recv = recv.view(n, layout.q_rows[me], heads, d + 1)
    o, lse = merge_many(recv[..., :-1], recv[..., -1])
    return o.to(q.dtype), lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Communicator, layout: RingLayout,
                   variant: str = "pass-kv", causal: bool = True, scale: Optional[float] = None,
                   steps: Optional[list[list[Block]]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`ring_attention_pass_kv` or `ring_attention_pass_q` by name."""
    if variant == "pass-kv":
        return ring_attention_pass_kv(q, k, v, group, layout, causal, scale, steps)
    if variant == "pass-q":
        return ring_attention_pass_q(q, k, v, group, layout, causal, scale, steps)
    raise RingAttentionError(f"ring variant {variant!r} is not one of {VARIANTS}")


def ring_step_flops(blocks: Sequence[Block], heads: int, head_dim: int) -> float:
    """Multiply-add FLOPs of one step's blocks (4 * d per visible query-key pair per head)."""
    pairs = 0
    for b in blocks:
        nq, nk = b.q1 - b.q0, b.k1 - b.k0
        pairs += nq * (nq + 1) // 2 if b.causal else nq * nk
    return 4.0 * head_dim * heads * pairs


__all__ = [
    "VARIANTS", "Block", "RingAttentionError", "RingLayout", "Run", "ZigzagShard", "attention_with_lse",
    "attention_with_lse_reference", "choose_ring_variant", "merge_across_ranks", "merge_many", "merge_partials",
    "plan_blocks", "ring_attention", "ring_attention_pass_kv", "ring_attention_pass_q", "ring_step_flops",
    "runs_from_positions", "zigzag_chunks",
]

"""Seconds per term (gemm, attention, elementwise, tp_comm, cp_ring, ep_comm, overhead) of one
pipeline stage's decoder layers running one micro-batch: what predict.py adds up per stage."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dist_infer.parallel.overlap_policy import should_split
from dist_infer.planner.rank_rates import RankRates
from dist_infer.planner.shapes import causal_attention_flops, linear_flops, max_shard
from dist_infer.planner.workload import DTYPE_BYTES as B, Setup


@dataclass(frozen=True)
class StagePass:
    """A stage running `seqs` sequences of `new_tokens` each after `context_before` cached ones;
    `measured`: the layout's timed fixed costs per layer and per step (they replace every latency);
    `last_stage`: its last layer is the model's, which a prefill runs on the sampled rows only."""

    seqs: int
    new_tokens: int
    context_before: int
    prefill: bool
    measured: Optional[dict] = None
    last_stage: bool = False

    @property
    def counted(self) -> bool:
        return self.measured is not None


@dataclass(frozen=True)
class LayerParts:
    """What every layer of a pass shares: the rank's rows and heads, its attention weights, and
    one layer's attention linears, dense MLP, elementwise work, attention core, tp all-reduce
    and cp ring, in seconds."""

    tokens: int
    q_heads: int
    kv_heads: int
    attn_w: float
    q_w: float
    t_attn_lin: float
    t_mlp: float
    t_ew: float
    t_core: float
    all_reduce: float
    split: bool
    ring: float


def attn_linears(s: Setup, rank: RankRates, rows: float, matrices: list) -> float:
    """`matrices`: [(parameters, row length)] of attention weights, at the weights' dtype."""
    return rank.linears(list(matrices), rows, s.work.weight_dtype, B[s.work.weight_dtype])


def o_proj(s: Setup, q_heads: int) -> tuple:
    """o_proj's (parameters, row length): it reads the rank's heads."""
    return s.shape.hidden * q_heads * s.shape.head_dim, q_heads * s.shape.head_dim


def mlp_linears(s: Setup, rank: RankRates, rows: float) -> float:
    """gate/up (reading the hidden state) and down_proj (its share of the intermediate size)."""
    shape, dtype = s.shape, s.work.mlp_dtype or s.work.weight_dtype
    inter = max_shard(shape.intermediate, s.layout.tp)
    gate_up, down = (2 * shape.hidden * inter, shape.hidden), (shape.hidden * inter, inter)
    return rank.linears([gate_up, down], rows, dtype, B[dtype])


def attention_core(s: Setup, rank: RankRates, sp: StagePass, tokens: int, q_heads: int) -> float:
    """Attention itself: a prefill's causal FLOPs on the zigzag layout (every cp rank holds 1/cp of
    each sequence's (query, key) pairs; only its two chunks' own triangles are causal, the ring's
    other blocks have no mask), or a decode's read of its KV shard."""
    shape, layout, work = s.shape, s.layout, s.work
    if sp.prefill:
        flops = sp.seqs * causal_attention_flops(q_heads, shape.head_dim, sp.new_tokens, sp.context_before) / layout.cp
        masked, masked_rows = flops, tokens
        if layout.cp > 1:
            masked_rows = math.ceil(sp.new_tokens / (2 * layout.cp))  # a zigzag chunk
            masked = min(flops, sp.seqs * 2 * causal_attention_flops(q_heads, shape.head_dim, masked_rows))
        return rank.attention(masked, 0.0, masked_rows, work.attention_dtype) + rank.attention(
            flops - masked, 0.0, tokens, work.attention_dtype, causal=False
        )
    ctx = sp.context_before + 1
    flops = sp.seqs * causal_attention_flops(q_heads, shape.head_dim, 1, math.ceil(ctx / layout.cp))
    kv_read = sp.seqs * math.ceil(ctx / layout.cp) * shape.kv_bytes_per_token(layout.tp, 1, B[work.kv_dtype])
    return rank.attention(flops, kv_read, tokens, work.attention_dtype, context=math.ceil(ctx / layout.cp))


def lse_gather(s: Setup, rank: RankRates, sp: StagePass, q_heads: int) -> float:
    """cp: every rank's partial output and LSE for the sampled rows, gathered for the merge."""
    return rank.collective(
        "all_gather",
        "cp",
        sp.seqs * s.layout.cp * (q_heads * s.shape.head_dim + q_heads) * 4,
        fixed=s.hw.cp_decode_layer_s or None,
        latency_counted=sp.counted,
    )


def cp_ring(s: Setup, rank: RankRates, sp: StagePass, tokens: int, q_heads: int, t_core: float) -> float:
    """A prefill's cp - 1 ring steps, each moving one rank's K/V block while attending to the one
    before; a decode's one token attended on every rank's KV shard and merged by LSE."""
    layout = s.layout
    if layout.cp <= 1:
        return 0.0
    if not sp.prefill:
        return lse_gather(s, rank, sp, q_heads)
    block = tokens * s.shape.kv_bytes_per_token(layout.tp, 1, B[s.work.kv_dtype])
    xfer = rank.collective("send_recv", "cp", block, fixed=s.hw.cp_step_s or None, latency_counted=sp.counted)
    step_compute = t_core / layout.cp if s.hw.comm_overlaps_compute else 0.0
    # the LSE merge of each step's partial output into the fp32 accumulators (read both, write one)
    merge = 3 * tokens * q_heads * (s.shape.head_dim + 1) * 4 / rank.bw
    return (layout.cp - 1) * (max(0.0, xfer - step_compute) + merge)


def layer_parts(s: Setup, rank: RankRates, sp: StagePass) -> LayerParts:
    """The per-layer pieces of one pass (see LayerParts)."""
    shape, layout, work = s.shape, s.layout, s.work
    tokens = sp.seqs * math.ceil(sp.new_tokens / layout.cp) if sp.prefill else sp.seqs  # this rank's rows
    q_heads, kv_heads = shape.heads_per_rank(layout.tp)
    attn_w = shape.attention_params_per_rank(layout.tp)
    o = o_proj(s, q_heads)
    qkv = (attn_w - o[0], shape.hidden)
    # norms, residual adds, rotary, SiLU x up, the cache write: memory-bound, once per row
    ew_bytes = (
        tokens
        * B[work.act_dtype]
        * (
            10 * shape.hidden
            + 2 * (q_heads + 2 * kv_heads) * shape.head_dim
            + 3 * max_shard(shape.intermediate, layout.tp)
        )
    )
    t_core = attention_core(s, rank, sp, tokens, q_heads)
    return LayerParts(
        tokens=tokens,
        q_heads=q_heads,
        kv_heads=kv_heads,
        attn_w=attn_w,
        q_w=o[0],
        t_attn_lin=attn_linears(s, rank, tokens, [qkv, o]),
        t_mlp=mlp_linears(s, rank, tokens),
        t_ew=ew_bytes / rank.bw,
        t_core=t_core,
        all_reduce=rank.collective(
            "all_reduce", "tp", tokens * shape.hidden * B[work.act_dtype], latency_counted=sp.counted
        ),
        split=should_split(s.sched.overlap, tokens, layout.tp, s.sched.overlap_threshold),
        ring=cp_ring(s, rank, sp, tokens, q_heads, t_core),
    )


def layer_overhead(s: Setup, rank: RankRates, sp: StagePass) -> float:
    """A layer's fixed cost: the measured one, or the profile's per-op latency on this rank's share."""
    if sp.measured is not None:
        return sp.measured["per_layer_s"]
    return s.hw.per_layer_s * rank.overhead_scale / rank.share


def moe_mlp(s: Setup, rank: RankRates, sp: StagePass, tokens: int) -> tuple[float, float]:
    """(expert GEMMs, ep communication): this ep rank's chunk of the tokens through the experts it owns."""
    shape, layout, work = s.shape, s.layout, s.work
    mlp_dtype = work.mlp_dtype or work.weight_dtype
    w = shape.mlp_params_per_rank(layout.tp, layout.ep, moe=True)
    chunk = math.ceil(tokens / layout.ep)
    active = shape.top_k * 3 * shape.hidden * math.ceil(shape.expert_intermediate / layout.tp)
    touched = min(shape.experts / layout.ep, chunk * shape.top_k) / max(1, shape.experts / layout.ep)
    t_m = rank.gemm(
        linear_flops(active, chunk), w * touched * B[mlp_dtype], chunk, mlp_dtype, shape.hidden
    )  # (two thirds of an expert's weights: gate and up)
    rows = chunk * shape.top_k * shape.hidden * B[work.act_dtype]
    ep = 2 * rank.collective("all_to_all", "ep", rows * layout.ep, latency_counted=sp.counted) + rank.collective(
        "all_gather", "ep", tokens * shape.hidden * B[work.act_dtype], latency_counted=sp.counted
    )
    return t_m, ep


def one_layer(s: Setup, rank: RankRates, sp: StagePass, parts: LayerParts, moe: bool) -> dict:
    """A decoder layer's terms (dense or mixture-of-experts); token splitting hides each half's
    all-reduce under the other half's compute."""
    t_m, ep = moe_mlp(s, rank, sp, parts.tokens) if moe else (parts.t_mlp, 0.0)
    comm = 2 * parts.all_reduce
    if parts.split and s.hw.comm_overlaps_compute:  # each half's all-reduce runs under the other half's compute
        comm = max(0.0, comm - (parts.t_attn_lin + parts.t_core + t_m + parts.t_ew) / 2)
    return {
        "gemm": parts.t_attn_lin + t_m,
        "attention": parts.t_core,
        "elementwise": parts.t_ew,
        "tp_comm": comm,
        "cp_ring": parts.ring,
        "ep_comm": ep,
        "overhead": layer_overhead(s, rank, sp),
    }


def trimmed_last_layer(s: Setup, rank: RankRates, sp: StagePass, parts: LayerParts) -> dict:
    """The model's last layer in a prefill (models/llama.py): every row's keys and values go to the
    cache, but queries, o_proj and the MLP run on each sequence's last row only, and with the native
    kernels (CPU) attention is that one row's over the prompt's cache."""
    shape, layout, work = s.shape, s.layout, s.work
    tokens, seqs, q_heads, q_w = parts.tokens, sp.seqs, parts.q_heads, parts.q_w
    kv_w = parts.attn_w - 2 * q_w
    native = s.hw.device == "cpu" and layout.cp == 1
    all_rows_w = kv_w if native else kv_w + q_w  # projected for every row
    gemm = (
        attn_linears(s, rank, tokens, [(all_rows_w, shape.hidden)])
        + attn_linears(s, rank, seqs, [(parts.attn_w - all_rows_w - q_w, shape.hidden), o_proj(s, q_heads)])
        + mlp_linears(s, rank, seqs)
    )
    ctx = math.ceil(sp.new_tokens / layout.cp) + sp.context_before
    last_row_only = native or layout.cp > 1  # else (GPU, no cp) attention runs in full, then is cut
    core = (
        parts.t_core
        if not last_row_only
        else rank.attention(
            seqs * causal_attention_flops(q_heads, shape.head_dim, 1, ctx),
            seqs * ctx * shape.kv_bytes_per_token(layout.tp, 1, B[work.kv_dtype]),
            seqs,
            work.attention_dtype,
            context=ctx,
        )
    )
    merge = lse_gather(s, rank, sp, q_heads) if layout.cp > 1 else 0.0
    ew = (
        tokens * B[work.act_dtype] * (2 * shape.hidden + 4 * parts.kv_heads * shape.head_dim) / rank.bw
        + parts.t_ew * seqs / tokens
    )
    return {
        "gemm": gemm,
        "attention": core,
        "elementwise": ew,
        "cp_ring": merge,
        "overhead": layer_overhead(s, rank, sp),
        "tp_comm": 2
        * rank.collective("all_reduce", "tp", seqs * shape.hidden * B[work.act_dtype], latency_counted=sp.counted),
    }


def stage_terms(s: Setup, rank: RankRates, sp: StagePass) -> dict:
    """Seconds per term for the stage's layers (its share of the model's dense and MoE layers)."""
    layers = math.ceil(s.shape.layers / s.layout.pp)
    moe_layers = math.ceil(s.shape.moe_layers / s.layout.pp)
    parts = layer_parts(s, rank, sp)
    trim = sp.prefill and sp.last_stage and not moe_layers  # (an MoE model: every layer counted in full)
    dense = scale_terms(one_layer(s, rank, sp, parts, False), layers - moe_layers - trim)
    if trim:
        dense = add_terms(dense, trimmed_last_layer(s, rank, sp, parts))
    return add_terms(dense, scale_terms(one_layer(s, rank, sp, parts, True), moe_layers)) if moe_layers else dense


def add_terms(*dicts: dict) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def scale_terms(d: dict, f: float) -> dict:
    return {k: v * f for k, v in d.items()}

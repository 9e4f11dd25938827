"""Predicted time to first token, time per output token and memory of one layout, from the
model's shape, a hardware profile and the engine's own schedules.

What the engine does, and so what is counted (per rank on the critical path):
- Each decoder layer: the linear layers' GEMMs (a roofline: FLOPs at the profile's GEMM rate
  for that many rows, or the weights streamed at memory bandwidth, whichever is longer),
  attention (causal prefill FLOPs, or the KV cache streamed in decode), and a fixed per-layer
  cost (kernel launches, Python). The model's last layer in a prefill runs queries, o_proj and
  the MLP on each sequence's last row only (keys and values of every row still go to the cache).
- tp: two all-reduces per layer (after o_proj and down_proj) of the rank's tokens x hidden,
  plus one after the vocab-parallel embedding; token splitting (`overlap`) hides each half's
  all-reduce behind the other half's compute, so only what exceeds that compute stays.
- cp: pass-KV ring attention on the zigzag layout: the local block, then cp - 1 steps, each
  receiving one rank's K/V while attending to the previous one; a step costs the longer of
  its transfer and its compute. Only the rank's two chunks' own triangles are causal; the
  other blocks have no mask and run at that rate where the profile has it. Decode attends each
  rank's KV shard and merges by LSE (one small all-gather per layer).
- pp: the batch goes as m micro-batches (the scheduler's ceil(B / pp) sequences per step): the
  prefill takes the first micro-batch's trip through every stage plus m - 1 times the slowest
  stage (the last: its layers and the LM head), a decode round the longer of m slowest stages
  and one trip; each hand-over sends the micro-batch's hidden states to the next stage.
- ep: attention replicated over ep; each ep rank routes tokens / ep, two all-to-alls of the
  routed rows, the experts' FLOPs balanced over ep, an all-gather of the tokens over ep.
- CPU profiles: the ranks on a node share its cores (threads per rank = cores / ranks) and its
  memory bandwidth: all ranks' work at the node's rates bounds the time from below; ranks that
  meet at collectives every layer and outnumber the cores run at their share of one; nothing is
  hidden behind compute (a transfer needs the same cores). A pipeline's stages run at the speed
  they have alone (as while it fills and drains); the node bound covers them running at once.
- A layout the profile timed (`decode_fixed`, `prefill_fixed`, from calibrate): that layout's
  measured fixed costs per layer and per step replace every per-op latency, and only bytes cross
  the links. On a CPU node they are wall time in which the waiting ranks hold the cores, so the
  node bound is every micro-batch's fixed costs plus all the ranks' work at the node's rates.
- Decode attention reads the KV cache at the rate the profile has for the rank's KV heads, head
  size, threads and context per sequence (the CPU kernel splits a context into chunks over the
  threads: a short one has few chunks and pays their merge); weights stream at the rate for their
  row length and for their matrix's size (a small matrix pays its call and start).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from dist_infer.comm.shm import DEFAULT_SLOT_BYTES, NBUF
from dist_infer.launch.cost_model.hardware import HardwareProfile, Link
from dist_infer.launch.cost_model.layout import Layout, why_not
from dist_infer.launch.cost_model.shapes import ModelShape, causal_attention_flops, linear_flops, max_shard
from dist_infer.models.llama import LlamaMLP
from dist_infer.parallel.token_split import should_split
from dist_infer.topology import AXES

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
MESH_ORDER = tuple(a for a in AXES if a != "dp")  # the engine's mesh order, fastest varying first (a plan has dp=1)
GIB = float(1 << 30)


@dataclass(frozen=True)
class Workload:
    batch: int
    prompt_len: int
    gen_len: int
    weight_dtype: str = "fp32"  # the GEMMs' dtype (its rate and the weights' bytes)
    mlp_dtype: str = ""  # the MLP's GEMMs when they differ (e.g. FP8 feed-forward, BF16 attention); "": weight_dtype
    act_dtype: str = "fp32"  # activations and what the collectives move
    attention_dtype: str = "fp32"
    kv_dtype: str = "fp32"


@dataclass(frozen=True)
class Schedule:
    """The engine's choices the time depends on."""

    overlap: str = "auto"  # token splitting: on / off / auto (from overlap_threshold tokens per step)
    overlap_threshold: Optional[int] = 1024  # None: auto never splits (the engine's CPU default)
    ranks_per_node: int = 8  # GPUs per node, or ranks started on each CPU node
    cores_per_node: Optional[int] = None  # CPU: the node's cores (None: the profile's)


@dataclass
class Prediction:
    layout: Layout
    ttft_s: float
    tpot_s: float
    memory_gib_per_rank: float
    fits: bool
    prefill: dict = field(default_factory=dict)  # seconds per term on the critical path
    decode: dict = field(default_factory=dict)  # seconds per term of one decode round
    memory: dict = field(default_factory=dict)  # GiB per term, the busiest rank

    @property
    def dominant_prefill(self) -> str:
        return max(self.prefill, key=self.prefill.get) if self.prefill else ""

    @property
    def dominant_decode(self) -> str:
        return max(self.decode, key=self.decode.get) if self.decode else ""

    def as_dict(self) -> dict:
        return {**self.layout.as_dict(), "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "memory_gib_per_rank": self.memory_gib_per_rank, "fits": self.fits,
                "dominant_prefill": self.dominant_prefill, "dominant_decode": self.dominant_decode,
                "prefill_terms_s": self.prefill, "decode_terms_s": self.decode, "memory_gib": self.memory}


def group_placement(layout: Layout, axis: str, ranks_per_node: int) -> tuple[bool, int]:
    """(whether an `axis` group spans nodes, how many of its ranks share each node), with ranks
    filling nodes in mesh order."""
    stride = 1
    for a in MESH_ORDER:
        n = getattr(layout, a)
        if a == axis:
            return (n > 1 and stride * n > ranks_per_node), max(1, min(n, ranks_per_node // stride))
        stride *= n
    raise ValueError(axis)


class _Rank:
    """Rates of one rank of `layout` on `hw`, and the links it talks over.

    On a CPU node (shared_node) two views: a rank alone (`node=False`: its own threads, the
    critical path when nothing else runs) and the node's capacity (`node=True`: all cores and the
    node's bandwidth, the overhead's CPU seconds spread over the cores, no waiting counted), so
    that the work of every rank on the node bounds the time from below."""

    def __init__(self, hw: HardwareProfile, layout: Layout, sched: Schedule, shape: ModelShape, node: bool = False,
                 busy_stages: int = 1):
        head_dim, kv_heads = shape.head_dim, shape.heads_per_rank(layout.tp)[1]
        self.hw, self.layout, self.sched, self.node, self.head_dim = hw, layout, sched, node, head_dim
        self.local = min(layout.ranks, sched.ranks_per_node)
        busy = self.local * min(busy_stages, layout.pp) / layout.pp  # ranks computing at once
        self.overhead_scale, self.share, self.oversubscribed = 1.0, 1.0, False
        if hw.shared_node:
            cores = sched.cores_per_node or hw.devices_per_node
            self.oversubscribed = busy > cores
            self.threads = cores if node else max(1, cores // self.local)
            self.overhead_scale = 1.0 / cores if node else 1.0
            if self.oversubscribed and not node and layout.tp * layout.cp * layout.ep > 1:
                # ranks that meet at a collective every layer cannot take turns on a core: each
                # runs at its share of one, waiting peers spin on theirs (pp stages with work at
                # once count; the others take turns, which the node view bounds)
                self.share = cores / busy
        else:
            self.threads = 1
        self.kv_heads = kv_heads
        self.bw = hw.bandwidth(self.threads) * self.share

    def kv_rate(self, context: float) -> float:
        """Bytes/s this rank's decode attention reads its KV shard at, for `context` tokens per
        sequence on the rank."""
        hw = self.hw
        rate = hw.kv_bandwidth(self.threads, self.head_dim, self.kv_heads, context) * self.share
        if self.node and hw.shared_node and self.local > 1:
            # the node's view: its ranks read their KV shards side by side, each at the rate for its
            # own threads (as many ranks as have a core), up to the node's memory bandwidth
            cores = self.sched.cores_per_node or hw.devices_per_node
            per_rank = max(1, cores // self.local)
            rate = min(self.bw, min(self.local, cores // per_rank)
                       * hw.kv_bandwidth(per_rank, self.head_dim, self.kv_heads, context))
        return rate

    def gemm(self, flops: float, weight_bytes: float, rows: float, dtype: str, row_length: float = math.inf) -> float:
        """The longer of the FLOPs at the GEMM rate for `rows` rows and the weights streamed at the
        rate for their `row_length` (input features) and their size (a small matrix streams slower:
        its call and the prefetchers' start are paid per matrix)."""
        if flops <= 0:
            return 0.0
        rate = self.hw.gemm_rate(dtype, self.threads, rows) * self.share
        stream = self.hw.bandwidth(self.threads, row_length) * self.hw.size_factor(self.threads, weight_bytes)
        return max(flops / rate, weight_bytes / (stream * self.share))

    def linears(self, matrices: list, rows: float, dtype: str, elem_bytes: float) -> float:
        """`matrices`: [(parameters, row length)] of this rank's weight matrices, each run on `rows` rows."""
        return sum(self.gemm(linear_flops(n, rows), n * elem_bytes, rows, dtype, k) for n, k in matrices if n > 0)

    def attention(self, flops: float, kv_bytes: float, rows: float, dtype: str, causal: bool = True,
                  context: float = 4096) -> float:
        """The longer of the FLOPs at the attention rate and the KV cache read at the rate for
        `context` tokens per sequence (decode)."""
        if flops <= 0:
            return 0.0
        rate = self.hw.attention_rate(dtype, self.threads, rows, self.head_dim, causal) * self.share
        return max(flops / rate, kv_bytes / self.kv_rate(context) if kv_bytes > 0 else 0.0)

    def collective(self, op: str, axis: str, nbytes: float, fixed: Optional[float] = None,
                   latency_counted: bool = False) -> float:
        """Seconds for `op` over this rank's `axis` group; `fixed` replaces the link's latency
        (a measured fixed cost that already holds it); `latency_counted`: only the bytes (the
        layout's measured fixed costs hold every latency and wait)."""
        n = getattr(self.layout, axis)
        if n <= 1 or nbytes <= 0 or self.node:  # the node view counts work, not waiting
            return 0.0
        if latency_counted:
            fixed = 0.0
        spans, per_node = group_placement(self.layout, axis, self.sched.ranks_per_node)
        scope = "inter" if spans else ("shm" if (axis == "tp" and op == "all_reduce" and self.hw.device == "cpu")
                                       else "intra")
        factor = {"all_reduce": 2.0 * (n - 1) / n, "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n,
                  "send_recv": 1.0}[op]
        link = self.hw.link(op, n, scope)
        if self.oversubscribed:
            # ranks outnumber the cores: every collective also waits for its peers to get a core
            if scope + "-over" in self.hw.collectives.get(op, {}):
                link = Link(link.latency_s, self.hw.link(op, n, scope + "-over").busbw)
            link = Link(link.latency_s + self.hw.sync_oversubscribed_s, link.busbw)
            if fixed is not None and not latency_counted:
                fixed += self.hw.sync_oversubscribed_s
        if spans and per_node > 1 and op != "send_recv":
            # NCCL runs one ring per NIC (rail): the group's ranks on a node cross between nodes in
            # parallel, each on its own NIC, so the bus bandwidth is theirs together, up to the node's links
            intra = self.hw.link(op, n, "intra")
            link = Link(link.latency_s, min(intra.busbw, link.busbw * per_node))
        if fixed is not None:
            link = Link(fixed, link.busbw)
        return link.time(nbytes, factor)


def predict(shape: ModelShape, layout: Layout, work: Workload, hw: HardwareProfile,
            sched: Schedule = Schedule()) -> Prediction:
    """The prediction for one layout (see the module docstring for what is counted)."""
    problem = why_not(layout, shape)
    if problem:
        raise ValueError(f"layout {layout.describe()}: {problem}")
    b = DTYPE_BYTES
    m = micro_batches(work.batch, layout.pp)
    mb = math.ceil(work.batch / m)  # sequences per micro-batch (the largest)
    layers = math.ceil(shape.layers / layout.pp)
    moe_layers = math.ceil(shape.moe_layers / layout.pp)

    def stage_pass(rank: _Rank, seqs: int, new_tokens: int, context_before: int, prefill: bool,
                   measured: Optional[dict] = None, last_stage: bool = False) -> dict:
        """Seconds per term for one stage running `seqs` sequences of `new_tokens` each; `measured`:
        the layout's fixed costs per layer and per step, timed (they replace every latency);
        `last_stage`: its last layer is the model's, which a prefill runs on the sampled rows only."""
        counted = measured is not None
        mlp_dtype = work.mlp_dtype or work.weight_dtype
        tokens = seqs * math.ceil(new_tokens / layout.cp) if prefill else seqs  # this rank's rows
        q_heads, kv_heads = shape.heads_per_rank(layout.tp)
        attn_w = shape.attention_params_per_rank(layout.tp)
        dense_w = shape.mlp_params_per_rank(layout.tp)
        # each matrix with its row length: q/k/v and gate/up read the hidden state, o_proj the
        # rank's heads, down_proj its share of the intermediate size
        q_w = shape.hidden * q_heads * shape.head_dim  # = o_proj's
        inter = max_shard(shape.intermediate, layout.tp)
        qkv, o = (attn_w - q_w, shape.hidden), (q_w, q_heads * shape.head_dim)
        gate_up, down = (2 * shape.hidden * inter, shape.hidden), (shape.hidden * inter, inter)

        def attn_linears(rows: float, matrices=(qkv, o)) -> float:
            return rank.linears(list(matrices), rows, work.weight_dtype, b[work.weight_dtype])

        def mlp_linears(rows: float) -> float:
            return rank.linears([gate_up, down], rows, mlp_dtype, b[mlp_dtype])

        t_attn_lin = attn_linears(tokens)
        t_mlp = mlp_linears(tokens)
        # norms, residual adds, rotary, SiLU x up, the cache write: memory-bound, once per row
        ew_bytes = tokens * b[work.act_dtype] * (10 * shape.hidden + 2 * (q_heads + 2 * kv_heads) * shape.head_dim
                                                 + 3 * max_shard(shape.intermediate, layout.tp))
        t_ew = ew_bytes / rank.bw
        if prefill:
            # zigzag: every cp rank holds 1/cp of each sequence's (query, key) pairs; only its two
            # chunks' own triangles are causal, the ring's other blocks have no mask
            flops = seqs * causal_attention_flops(q_heads, shape.head_dim, new_tokens, context_before) / layout.cp
            masked, masked_rows = flops, tokens
            if layout.cp > 1:
                masked_rows = math.ceil(new_tokens / (2 * layout.cp))  # a zigzag chunk
                masked = min(flops, seqs * 2 * causal_attention_flops(q_heads, shape.head_dim, masked_rows))
            t_core = (rank.attention(masked, 0.0, masked_rows, work.attention_dtype)
                      + rank.attention(flops - masked, 0.0, tokens, work.attention_dtype, causal=False))
        else:
            ctx = context_before + 1
            flops = seqs * causal_attention_flops(q_heads, shape.head_dim, 1, math.ceil(ctx / layout.cp))
            kv_read = seqs * math.ceil(ctx / layout.cp) * shape.kv_bytes_per_token(layout.tp, 1, b[work.kv_dtype])
            t_core = rank.attention(flops, kv_read, tokens, work.attention_dtype, context=math.ceil(ctx / layout.cp))

        def lse_gather() -> float:
            """cp: every rank's partial output and LSE for the sampled rows, gathered for the merge."""
            return rank.collective("all_gather", "cp", seqs * layout.cp * (q_heads * shape.head_dim + q_heads) * 4,
                                   fixed=hw.cp_decode_layer_s or None, latency_counted=counted)

        ar = rank.collective("all_reduce", "tp", tokens * shape.hidden * b[work.act_dtype], latency_counted=counted)
        split = should_split(sched.overlap, tokens, layout.tp, sched.overlap_threshold)
        ring = 0.0
        if layout.cp > 1 and prefill:
            # cp - 1 steps; each moves one rank's K/V block while attending to the one before
            block = tokens * shape.kv_bytes_per_token(layout.tp, 1, b[work.kv_dtype])
            xfer = rank.collective("send_recv", "cp", block, fixed=hw.cp_step_s or None, latency_counted=counted)
            step_compute = t_core / layout.cp if hw.comm_overlaps_compute else 0.0
            # the LSE merge of each step's partial output into the fp32 accumulators (read both, write one)
            merge = 3 * tokens * q_heads * (shape.head_dim + 1) * 4 / rank.bw
            ring = (layout.cp - 1) * (max(0.0, xfer - step_compute) + merge)
        elif layout.cp > 1:  # decode: one token, attended on every rank's KV shard, merged by LSE
            ring = lse_gather()

        def one_layer(moe: bool) -> dict:
            t_m, ep = t_mlp, 0.0
            if moe:  # this ep rank's chunk of the tokens through the experts it owns
                w = shape.mlp_params_per_rank(layout.tp, layout.ep, moe=True)
                chunk = math.ceil(tokens / layout.ep)
                active = shape.top_k * 3 * shape.hidden * math.ceil(shape.expert_intermediate / layout.tp)
                touched = min(shape.experts / layout.ep, chunk * shape.top_k) / max(1, shape.experts / layout.ep)
                t_m = rank.gemm(linear_flops(active, chunk), w * touched * b[mlp_dtype], chunk, mlp_dtype,
                                shape.hidden)  # (two thirds of an expert's weights: gate and up)
                rows = chunk * shape.top_k * shape.hidden * b[work.act_dtype]
                ep = 2 * rank.collective("all_to_all", "ep", rows * layout.ep, latency_counted=counted) + rank.collective(
                    "all_gather", "ep", tokens * shape.hidden * b[work.act_dtype], latency_counted=counted)
            comm = 2 * ar
            if split and hw.comm_overlaps_compute:  # each half's all-reduce runs under the other half's compute
                comm = max(0.0, comm - (t_attn_lin + t_core + t_m + t_ew) / 2)
            overhead = measured["per_layer_s"] if counted else hw.per_layer_s * rank.overhead_scale / rank.share
            return {"gemm": t_attn_lin + t_m, "attention": t_core, "elementwise": t_ew, "tp_comm": comm,
                    "cp_ring": ring, "ep_comm": ep, "overhead": overhead}

        def trimmed_last_layer() -> dict:
            """The model's last layer in a prefill (models/llama.py): every row's keys and values go
            to the cache, but queries, o_proj and the MLP run on each sequence's last row only, and
            with the native kernels (CPU) attention is that one row's over the prompt's cache."""
            kv_w = attn_w - 2 * q_w
            native = hw.device == "cpu" and layout.cp == 1
            all_rows_w = kv_w if native else kv_w + q_w  # projected for every row
            gemm = (attn_linears(tokens, [(all_rows_w, shape.hidden)])
                    + attn_linears(seqs, [(attn_w - all_rows_w - q_w, shape.hidden), o]) + mlp_linears(seqs))
            ctx = math.ceil(new_tokens / layout.cp) + context_before
            last_row_only = native or layout.cp > 1  # else (GPU, no cp) attention runs in full, then is cut
            core = t_core if not last_row_only else rank.attention(
                seqs * causal_attention_flops(q_heads, shape.head_dim, 1, ctx),
                seqs * ctx * shape.kv_bytes_per_token(layout.tp, 1, b[work.kv_dtype]), seqs, work.attention_dtype,
                context=ctx)
            merge = lse_gather() if layout.cp > 1 else 0.0
            ew = (tokens * b[work.act_dtype] * (2 * shape.hidden + 4 * kv_heads * shape.head_dim) / rank.bw
                  + t_ew * seqs / tokens)
            overhead = measured["per_layer_s"] if counted else hw.per_layer_s * rank.overhead_scale / rank.share
            return {"gemm": gemm, "attention": core, "elementwise": ew, "cp_ring": merge, "overhead": overhead,
                    "tp_comm": 2 * rank.collective("all_reduce", "tp", seqs * shape.hidden * b[work.act_dtype],
                                                   latency_counted=counted)}

        trim = prefill and last_stage and not moe_layers  # (an MoE model: every layer counted in full)
        dense = _scale(one_layer(False), layers - moe_layers - trim)
        if trim:
            dense = _add(dense, trimmed_last_layer())
        return _add(dense, _scale(one_layer(True), moe_layers)) if moe_layers else dense

    def head_pass(rank: _Rank, rows: int, counted: bool = False) -> dict:
        """Embedding all-reduce (first stage) and the LM head on the sampled rows (last stage)."""
        v = shape.vocab_per_rank(layout.tp)
        return {"gemm": rank.gemm(linear_flops(v * shape.hidden, rows), v * shape.hidden * b[work.weight_dtype], rows,
                                  work.weight_dtype, shape.hidden),
                "tp_comm": rank.collective("all_gather", "tp", rows * shape.vocab * 4, latency_counted=counted)}

    def pipeline(rank: _Rank, layer_part: dict, rows: int, tokens: int,
                 measured: Optional[dict] = None, last_part: Optional[dict] = None) -> tuple[float, float, dict]:
        """(time of the first micro-batch through every stage, the slowest stage's time, the
        mean stage's terms) for micro-batches of `rows` sampled rows and `tokens` tokens per rank.
        The first stage also runs the embedding's all-reduce and the driver's step; the last the
        LM head (and its layers are `last_part`, when given); every stage but the last hands its
        hidden states on."""
        act = tokens * shape.hidden * b[work.act_dtype]
        counted = measured is not None
        first = {"tp_comm": rank.collective("all_reduce", "tp", act, latency_counted=counted),
                 "overhead": measured["per_step_s"] if counted else hw.per_step_s * rank.overhead_scale / rank.share}
        last = head_pass(rank, rows, counted)
        send = {"pp_transfer": rank.collective("send_recv", "pp", act, latency_counted=counted)} if layout.pp > 1 else {}
        last_part = layer_part if last_part is None else last_part
        if layout.pp == 1:
            stages = [_add(last_part, first, last)]
        else:
            middle = [_add(layer_part, send)] * (layout.pp - 2)
            stages = [_add(layer_part, first, send)] + middle + [_add(last_part, last)]
        totals = [sum(st.values()) for st in stages]
        return sum(totals), max(totals), _scale(_add(*stages), 1.0 / layout.pp)

    rank = _Rank(hw, layout, sched, shape, busy_stages=m)
    node = _Rank(hw, layout, sched, shape, node=True) if hw.shared_node else None
    # ranks on the busiest node, per stage of one pp group: its share of the job's work
    node_share = rank.local / layout.ranks

    def node_time(layer_part: dict, rows: int, tokens: int, last_part: Optional[dict] = None,
                  trip_fixed: Optional[float] = None) -> float:
        """Seconds of the node's capacity that one micro-batch's pass through every stage uses
        on the busiest node (all its ranks' work). `trip_fixed`: the layout's measured fixed costs
        of that pass, wall time in place of the ranks' own overheads: while ranks wait at a
        collective or a hand-over they hold the cores (a wait spins before it sleeps), so the
        bytes the ranks stream through the shared memory bus come on top, not beside."""
        _, _, mean = pipeline(node, layer_part, rows, tokens, last_part=last_part)
        if trip_fixed is not None:
            mean.pop("overhead", None)
        return sum(mean.values()) * layout.pp * (layout.ranks / layout.pp) * node_share + (trip_fixed or 0.0)

    # -- prefill: m micro-batches chase each other through the pp stages --------------------------
    # each stage's ranks at the speed they have when theirs is the only stage computing (as while
    # the pipeline fills and drains); when several stages compute at once and outnumber the cores,
    # the node bound below (all ranks' work on the node's cores) takes over
    alone = _Rank(hw, layout, sched, shape, busy_stages=1)
    p_tokens = mb * math.ceil(work.prompt_len / layout.cp)
    timed = hw.prefill_fixed.get(layout.describe()) if layout.ranks > 1 else None
    through, slowest, mean = pipeline(
        alone, stage_pass(alone, mb, work.prompt_len, 0, prefill=True, measured=timed), mb, p_tokens, timed,
        last_part=stage_pass(alone, mb, work.prompt_len, 0, prefill=True, measured=timed, last_stage=True))
    ttft = through + (m - 1) * slowest
    prefill = _scale(mean, m)
    if layout.pp > 1:  # filling the pipeline and uneven stages: the time beyond m mean stages
        prefill["pp_bubble"] = max(0.0, ttft - sum(prefill.values()))
    if node is not None:  # the node's cores and bandwidth shared by all its ranks
        busy = m * node_time(stage_pass(node, mb, work.prompt_len, 0, prefill=True), mb, p_tokens,
                             stage_pass(node, mb, work.prompt_len, 0, prefill=True, last_stage=True),
                             trip_fixed=_trip(timed, shape.layers))
        if busy > ttft:
            prefill["node_shared"], ttft = busy - ttft, busy

    # -- decode: one round = every sequence one token, at the mean context -----------------------
    ctx = work.prompt_len + max(0, work.gen_len - 1) // 2
    measured = hw.decode_fixed.get(layout.describe()) if layout.ranks > 1 else None
    through, slowest, mean = pipeline(rank, stage_pass(rank, mb, 1, ctx, prefill=False, measured=measured), mb, mb,
                                      measured)
    tpot = max(m * slowest, through)  # the slowest stage's m passes, or one token's trip through all stages
    decode = _scale(mean, m)
    if layout.pp > 1:
        decode["pp_bubble"] = max(0.0, tpot - sum(decode.values()))
    if node is not None:
        busy = m * node_time(stage_pass(node, mb, 1, ctx, prefill=False), mb, mb, trip_fixed=_trip(measured, shape.layers))
        if busy > tpot:
            decode["node_shared"], tpot = busy - tpot, busy

    memory = memory_per_rank(shape, layout, work, hw, sched.ranks_per_node)
    total = sum(memory.values())
    fits = total * GIB <= hw.memory_bytes
    return Prediction(layout, ttft_s=ttft, tpot_s=tpot,
                      memory_gib_per_rank=total, fits=fits,
                      prefill={k: v for k, v in prefill.items() if v > 0},
                      decode={k: v for k, v in decode.items() if v > 0}, memory=memory)


def _trip(measured: Optional[dict], layers: int) -> Optional[float]:
    """A layout's measured fixed costs of one micro-batch's trip through all `layers`."""
    return measured["per_step_s"] + layers * measured["per_layer_s"] if measured else None


def _add(*dicts: dict) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _scale(d: dict, f: float) -> dict:
    return {k: v * f for k, v in d.items()}


def micro_batches(batch: int, pp: int) -> int:
    """How many steps the scheduler cuts a batch into with pp stages (ceil(B / pp) sequences each)."""
    if pp <= 1:
        return 1
    per = math.ceil(batch / pp)
    return math.ceil(batch / per)


def memory_per_rank(shape: ModelShape, layout: Layout, work: Workload, hw: HardwareProfile,
                    ranks_per_node: Optional[int] = None) -> dict:
    """GiB on the busiest rank: weights, KV cache, the largest step's activations, the runtime and,
    on a CPU node, the shared-memory collectives' segments (all ranks on one node unless
    `ranks_per_node` says otherwise)."""
    b = DTYPE_BYTES
    layers = math.ceil(shape.layers / layout.pp)
    moe_layers = math.ceil(shape.moe_layers / layout.pp)
    mlp = (layers - moe_layers) * shape.mlp_params_per_rank(layout.tp) + moe_layers * (
        shape.mlp_params_per_rank(layout.tp, layout.ep, moe=True))
    vocab = shape.vocab_per_rank(layout.tp) * shape.hidden
    embed = vocab * (2 if not shape.tied and layout.pp == 1 else 1)  # the embedding and the LM head
    weights_b = ((layers * shape.attention_params_per_rank(layout.tp) + embed) * b[work.weight_dtype]
                 + mlp * b[work.mlp_dtype or work.weight_dtype])
    seq_tokens = math.ceil((work.prompt_len + work.gen_len) / layout.cp)
    micro = math.ceil(work.batch / micro_batches(work.batch, layout.pp))
    kv = micro_batches(work.batch, layout.pp) * micro * seq_tokens * shape.kv_bytes_per_token(
        layout.tp, layers, b[work.kv_dtype])
    rows = micro * math.ceil(work.prompt_len / layout.cp)
    q_heads, kv_heads = shape.heads_per_rank(layout.tp)
    act_row = (4 * shape.hidden + (q_heads + 2 * kv_heads) * shape.head_dim) * b[work.act_dtype]
    mlp_rows = min(rows, LlamaMLP.ROW_CHUNK)  # a long prefill's MLP runs in slices of this many rows
    act = rows * act_row + mlp_rows * 3 * max_shard(shape.intermediate, layout.tp) * b[work.act_dtype]
    if layout.cp > 1:  # the ring's two K/V receive buffers and fp32 accumulators
        act += (2 * rows * shape.kv_bytes_per_token(layout.tp, 1, b[work.kv_dtype])
                + rows * q_heads * (shape.head_dim + 1) * 4)
    mem = {"weights": weights_b / GIB, "kv_cache": kv / GIB, "activations": act / GIB,
           "runtime": hw.base_memory_bytes / GIB}
    if hw.device == "cpu":
        act_b = b[work.act_dtype]
        messages = {"tp": (rows * shape.hidden * act_b, micro * shape.hidden * act_b,
                           micro * shape.vocab_per_rank(layout.tp) * 4),  # hidden states, the LM head's logits
                    "cp": (micro * q_heads * (shape.head_dim + 1) * 4,)}  # a decode's partials and LSEs
        mem["comm_buffers"] = sum(shm_segment_bytes(getattr(layout, axis), sizes)
                                  for axis, sizes in messages.items()
                                  if not group_placement(layout, axis, ranks_per_node or layout.ranks)[0]) / GIB
    return mem


def shm_segment_bytes(group_size: int, messages) -> float:
    """Bytes of a node-local group's shared segment (comm/shm.py) in each rank's resident memory:
    an op writes its tensor into this rank's slot of one of NBUF buffers in turn and reads every
    rank's slot, so the largest tensor that fits a slot is resident NBUF x group_size times (the long
    prompt's tp=2 prefill, 8 MiB per all-reduce: 55-58 MiB more peak RSS per rank than with --shm off)."""
    fitting = [m for m in messages if 0 < m <= DEFAULT_SLOT_BYTES]
    return NBUF * group_size * max(fitting) if group_size > 1 and fitting else 0.0

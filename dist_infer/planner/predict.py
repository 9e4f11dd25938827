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

from dist_infer.planner.hardware import HardwareProfile
from dist_infer.planner.layout import Layout, why_not
from dist_infer.planner.memory import memory_per_rank
from dist_infer.planner.rank_rates import RankRates
from dist_infer.planner.shapes import ModelShape, linear_flops
from dist_infer.planner.stage_terms import StagePass, add_terms, scale_terms, stage_terms
from dist_infer.planner.workload import DTYPE_BYTES as B, GIB, Schedule, Setup, Workload, micro_batches


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
        return max(self.prefill, key=self.prefill.__getitem__) if self.prefill else ""

    @property
    def dominant_decode(self) -> str:
        return max(self.decode, key=self.decode.__getitem__) if self.decode else ""

    def as_dict(self) -> dict:
        return {
            **self.layout.as_dict(),
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "memory_gib_per_rank": self.memory_gib_per_rank,
            "fits": self.fits,
            "dominant_prefill": self.dominant_prefill,
            "dominant_decode": self.dominant_decode,
            "prefill_terms_s": self.prefill,
            "decode_terms_s": self.decode,
            "memory_gib": self.memory,
        }


def head_pass(s: Setup, rank: RankRates, rows: int, counted: bool = False) -> dict:
    """Embedding all-reduce (first stage) and the LM head on the sampled rows (last stage)."""
    shape, work = s.shape, s.work
    v = shape.vocab_per_rank(s.layout.tp)
    return {
        "gemm": rank.gemm(
            linear_flops(v * shape.hidden, rows),
            v * shape.hidden * B[work.weight_dtype],
            rows,
            work.weight_dtype,
            shape.hidden,
        ),
        "tp_comm": rank.collective("all_gather", "tp", rows * shape.vocab * 4, latency_counted=counted),
    }


def pipeline(
    s: Setup,
    rank: RankRates,
    layer_part: dict,
    rows: int,
    tokens: int,
    measured: Optional[dict] = None,
    last_part: Optional[dict] = None,
) -> tuple[float, float, dict]:
    """(time of the first micro-batch through every stage, the slowest stage's time, the
    mean stage's terms) for micro-batches of `rows` sampled rows and `tokens` tokens per rank.
    The first stage also runs the embedding's all-reduce and the driver's step; the last the
    LM head (and its layers are `last_part`, when given); every stage but the last hands its
    hidden states on."""
    layout, hw = s.layout, s.hw
    act = tokens * s.shape.hidden * B[s.work.act_dtype]
    counted = measured is not None
    first = {
        "tp_comm": rank.collective("all_reduce", "tp", act, latency_counted=counted),
        "overhead": measured["per_step_s"]
        if measured is not None
        else hw.per_step_s * rank.overhead_scale / rank.share,
    }
    last = head_pass(s, rank, rows, counted)
    send = {"pp_transfer": rank.collective("send_recv", "pp", act, latency_counted=counted)} if layout.pp > 1 else {}
    last_part = layer_part if last_part is None else last_part
    if layout.pp == 1:
        stages = [add_terms(last_part, first, last)]
    else:
        middle = [add_terms(layer_part, send)] * (layout.pp - 2)
        stages = [add_terms(layer_part, first, send)] + middle + [add_terms(last_part, last)]
    totals = [sum(st.values()) for st in stages]
    return sum(totals), max(totals), scale_terms(add_terms(*stages), 1.0 / layout.pp)


def node_time(
    s: Setup,
    node: RankRates,
    node_share: float,
    layer_part: dict,
    rows: int,
    tokens: int,
    last_part: Optional[dict] = None,
    trip_fixed: Optional[float] = None,
) -> float:
    """Seconds of the node's capacity that one micro-batch's pass through every stage uses
    on the busiest node (all its ranks' work). `trip_fixed`: the layout's measured fixed costs
    of that pass, wall time in place of the ranks' own overheads: while ranks wait at a
    collective or a hand-over they hold the cores (a wait spins before it sleeps), so the
    bytes the ranks stream through the shared memory bus come on top, not beside."""
    layout = s.layout
    _, _, mean = pipeline(s, node, layer_part, rows, tokens, last_part=last_part)
    if trip_fixed is not None:
        mean.pop("overhead", None)
    return sum(mean.values()) * layout.pp * (layout.ranks / layout.pp) * node_share + (trip_fixed or 0.0)


def predict_prefill(s: Setup, m: int, mb: int, node: Optional[RankRates], node_share: float) -> tuple[float, dict]:
    """(time to first token, its terms): m micro-batches chase each other through the pp stages,
    each stage's ranks at the speed they have when theirs is the only stage computing (as while
    the pipeline fills and drains); when several stages compute at once and outnumber the cores,
    the node bound (all ranks' work on the node's cores) takes over."""
    layout, prompt = s.layout, s.work.prompt_len
    alone = RankRates(s.hw, layout, s.sched, s.shape, busy_stages=1)
    p_tokens = mb * math.ceil(prompt / layout.cp)
    timed = s.hw.prefill_fixed.get(layout.describe()) if layout.ranks > 1 else None
    through, slowest, mean = pipeline(
        s,
        alone,
        stage_terms(s, alone, StagePass(mb, prompt, 0, True, timed)),
        mb,
        p_tokens,
        timed,
        last_part=stage_terms(s, alone, StagePass(mb, prompt, 0, True, timed, last_stage=True)),
    )
    ttft = through + (m - 1) * slowest
    prefill = scale_terms(mean, m)
    if layout.pp > 1:  # filling the pipeline and uneven stages: the time beyond m mean stages
        prefill["pp_bubble"] = max(0.0, ttft - sum(prefill.values()))
    if node is not None:  # the node's cores and bandwidth shared by all its ranks
        busy = m * node_time(
            s,
            node,
            node_share,
            stage_terms(s, node, StagePass(mb, prompt, 0, True)),
            mb,
            p_tokens,
            stage_terms(s, node, StagePass(mb, prompt, 0, True, last_stage=True)),
            trip_fixed=_trip(timed, s.shape.layers),
        )
        if busy > ttft:
            prefill["node_shared"], ttft = busy - ttft, busy
    return ttft, prefill


def predict_decode(s: Setup, m: int, mb: int, node: Optional[RankRates], node_share: float) -> tuple[float, dict]:
    """(time per output token, its terms): one round = every sequence one token, at the mean context."""
    layout = s.layout
    rank = RankRates(s.hw, layout, s.sched, s.shape, busy_stages=m)
    ctx = s.work.prompt_len + max(0, s.work.gen_len - 1) // 2
    measured = s.hw.decode_fixed.get(layout.describe()) if layout.ranks > 1 else None
    through, slowest, mean = pipeline(
        s, rank, stage_terms(s, rank, StagePass(mb, 1, ctx, False, measured)), mb, mb, measured
    )
    tpot = max(m * slowest, through)  # the slowest stage's m passes, or one token's trip through all stages
    decode = scale_terms(mean, m)
    if layout.pp > 1:
        decode["pp_bubble"] = max(0.0, tpot - sum(decode.values()))
    if node is not None:
        busy = m * node_time(
            s,
            node,
            node_share,
            stage_terms(s, node, StagePass(mb, 1, ctx, False)),
            mb,
            mb,
            trip_fixed=_trip(measured, s.shape.layers),
        )
        if busy > tpot:
            decode["node_shared"], tpot = busy - tpot, busy
    return tpot, decode


def predict(
    shape: ModelShape, layout: Layout, work: Workload, hw: HardwareProfile, sched: Schedule = Schedule()
) -> Prediction:
    """The prediction for one layout (see the module docstring for what is counted)."""
    problem = why_not(layout, shape)
    if problem:
        raise ValueError(f"layout {layout.describe()}: {problem}")
    s = Setup(shape, layout, work, hw, sched)
    m = micro_batches(work.batch, layout.pp)
    mb = math.ceil(work.batch / m)  # sequences per micro-batch (the largest)
    # ranks on the busiest node, per stage of one pp group: its share of the job's work
    node_share = min(layout.ranks, sched.ranks_per_node) / layout.ranks
    node = RankRates(hw, layout, sched, shape, node=True) if hw.shared_node else None
    ttft, prefill = predict_prefill(s, m, mb, node, node_share)
    tpot, decode = predict_decode(s, m, mb, node, node_share)
    memory = memory_per_rank(shape, layout, work, hw, sched.ranks_per_node)
    total = sum(memory.values())
    fits = total * GIB <= hw.memory_bytes
    return Prediction(
        layout,
        ttft_s=ttft,
        tpot_s=tpot,
        memory_gib_per_rank=total,
        fits=fits,
        prefill={k: v for k, v in prefill.items() if v > 0},
        decode={k: v for k, v in decode.items() if v > 0},
        memory=memory,
    )


def _trip(measured: Optional[dict], layers: int) -> Optional[float]:
    """A layout's measured fixed costs of one micro-batch's trip through all `layers`."""
    return measured["per_step_s"] + layers * measured["per_layer_s"] if measured else None

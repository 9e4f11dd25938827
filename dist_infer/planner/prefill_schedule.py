"""Chunked against layered prefill (engine/layered_prefill.py), predicted: one prompt of P tokens
arriving beside D running decodes under a token budget of C tokens a step.

Chunked: ceil(P / (C - D)) steps, each running its chunk and the decodes through every layer.
Layered: the whole prompt through one of G = ceil(P / (C - D)) layer groups a step (at most one per
layer), the decodes through every layer. Each step's time on one rank is its layers' time: the
weights it reads at the rank's streaming bandwidth or its GEMM FLOPs at the GEMM rate, whichever is
longer, plus causal attention and the profile's fixed costs per layer and per step. An MoE layer
reads only the experts its rows route to: with uniform routing, rows r of top-k over E experts touch
E (1 - (1 - k/E)^r) of them. Collectives are left out (both schedules move the same activations).
Pure arithmetic, unit tested; `dist-infer plan` prints it for the best layout.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from dist_infer.planner.layout import Layout
from dist_infer.planner.rank_rates import RankRates
from dist_infer.planner.shapes import causal_attention_flops, max_shard
from dist_infer.planner.workload import DTYPE_BYTES, Setup


@dataclass(frozen=True)
class SchedulePrediction:
    schedule: str
    steps: int  # steps the prompt takes (its TTFT counts them)
    step_s: float  # the longest of its steps: the running decodes' inter-token gap meanwhile
    ttft_s: float
    expert_bytes: float  # MoE weights read (all ranks) in the prompt's steps; 0 for a dense model

    def as_dict(self) -> dict:
        return asdict(self)


def experts_touched(rows: float, experts: int, top_k: int) -> float:
    """Expected experts with at least one of `rows` tokens, each routed to top_k of `experts` uniformly."""
    if experts == 0 or rows <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def _layer_s(s: Setup, rank: RankRates, moe: bool, rows: float, new_tokens: float, context: float) -> float:
    """One layer of one rank on `rows` tokens (of which a prompt's `new_tokens` after `context`)."""
    shape, lay, hw = s.shape, s.layout, s.hw
    dtype, elem = s.work.weight_dtype, DTYPE_BYTES[s.work.weight_dtype]
    params = shape.attention_params_per_rank(lay.tp)
    read: float = params
    if moe:
        per_expert = 3 * shape.hidden * max_shard(shape.expert_intermediate, lay.tp)
        shared = (
            3 * shape.hidden * max_shard(shape.shared_expert_intermediate, lay.tp)
            if shape.shared_expert_intermediate
            else 0
        )
        touched = experts_touched(rows, math.ceil(shape.experts / lay.ep), shape.top_k)
        read += touched * per_expert + shared + shape.hidden * shape.experts
        params += shape.top_k * per_expert + shared  # per row
    else:
        params += shape.mlp_params_per_rank(lay.tp)
        read = params
    gemm = 2.0 * params * rows / hw.gemm_rate(dtype, rank.threads, rows)
    stream = read * elem / rank.bw
    q_heads = shape.heads_per_rank(lay.tp)[0]
    attention = (
        causal_attention_flops(q_heads, shape.head_dim, int(new_tokens), int(context))
        / hw.attention_rate(dtype, rank.threads, max(new_tokens, 1.0), shape.head_dim)
        if new_tokens
        else 0.0
    )
    return max(gemm, stream) + attention + hw.per_layer_s


def _step_s(s: Setup, rank: RankRates, layers: range, rows: float, new: float, context: float, decodes: int) -> float:
    """A step: layers in `layers` carry the prompt's rows beside the decodes, the rest only the decodes."""
    sparse = s.shape.moe_layers / s.shape.layers  # each layer as the model's mix of sparse and dense ones

    def layer(rows_in: float, new_in: float, context_in: float) -> float:
        moe = _layer_s(s, rank, True, rows_in, new_in, context_in) if sparse else 0.0
        dense = _layer_s(s, rank, False, rows_in, new_in, context_in) if sparse < 1 else 0.0
        return sparse * moe + (1 - sparse) * dense

    inside = layer(rows + decodes, new, context)
    outside = layer(decodes, 0, 0) if decodes else 0.0
    return s.hw.per_step_s + len(layers) * inside + (s.shape.layers - len(layers)) * outside


def predict_prefill_schedules(
    s: Setup, prompt: int, budget: int, decodes: int
) -> dict[str, Optional[SchedulePrediction]]:
    """{'chunked': ..., 'layered': ...} for one prompt of `prompt` tokens beside `decodes` running
    decodes under `budget` tokens a step; layered is None where the engine cannot run it (pp > 1, cp > 1)."""
    if budget <= decodes:
        raise ValueError(f"a budget of {budget} tokens leaves no room beside {decodes} decodes")
    shape, room = s.shape, budget - decodes
    rank = RankRates(s.hw, s.layout, s.sched, shape)
    expert_elem = DTYPE_BYTES[s.work.weight_dtype] * 3 * shape.hidden * shape.expert_intermediate
    chunks = math.ceil(prompt / room)
    times, expert_bytes = [], 0.0
    for c in range(chunks):
        n = min(room, prompt - c * room)
        times.append(_step_s(s, rank, range(shape.layers), n, n, c * room, decodes))
        expert_bytes += shape.moe_layers * experts_touched(n + decodes, shape.experts, shape.top_k) * expert_elem
    out: dict[str, Optional[SchedulePrediction]] = {
        "chunked": SchedulePrediction("chunked", chunks, max(times), sum(times), expert_bytes),
        "layered": None,
    }
    if s.layout.pp > 1 or s.layout.cp > 1:
        return out
    groups = max(1, min(shape.layers, chunks))
    base, extra = divmod(shape.layers, groups)
    times, first = [], 0
    for g in range(groups):
        end = first + base + (1 if g < extra else 0)
        times.append(_step_s(s, rank, range(first, end), prompt, prompt, 0, decodes))
        first = end
    layered_bytes = shape.moe_layers * experts_touched(prompt + decodes, shape.experts, shape.top_k) * expert_elem
    out["layered"] = SchedulePrediction("layered", groups, max(times), sum(times), layered_bytes)
    return out


def format_prefill_schedules(preds: dict, layout: Layout, prompt: int, budget: int, decodes: int) -> str:
    lines = [
        f"prefill schedules ({layout.describe()}): a {prompt}-token prompt beside {decodes} decodes, "
        f"{budget} tokens a step"
    ]
    for name, p in preds.items():
        if p is None:
            lines.append(f"  {name:<8} not supported with pp > 1 or cp > 1")
            continue
        lines.append(
            f"  {name:<8} {p.steps:>4} steps, TTFT {p.ttft_s:.3g} s, longest step (decode gap) "
            f"{p.step_s * 1e3:.3g} ms"
            + (f", expert weights read {p.expert_bytes / 2**30:.3g} GiB" if p.expert_bytes else "")
        )
    return "\n".join(lines)

"""Memory on the busiest rank of a layout: weights, KV cache, the largest step's activations, the
runtime and, on a CPU node, the shared-memory collectives' segments."""

from __future__ import annotations

import math
from typing import Optional

from dist_infer.comm.shm_sizes import DEFAULT_SLOT_BYTES, NBUF
from dist_infer.planner.engine_facts import MLP_ROW_CHUNK
from dist_infer.planner.hardware import HardwareProfile
from dist_infer.planner.layout import Layout
from dist_infer.planner.rank_rates import group_placement
from dist_infer.planner.shapes import ModelShape, max_shard
from dist_infer.planner.workload import DTYPE_BYTES, GIB, Workload, micro_batches


def memory_per_rank(
    shape: ModelShape, layout: Layout, work: Workload, hw: HardwareProfile, ranks_per_node: Optional[int] = None
) -> dict:
    """GiB on the busiest rank: weights, KV cache, the largest step's activations, the runtime and,
    on a CPU node, the shared-memory collectives' segments (all ranks on one node unless
    `ranks_per_node` says otherwise)."""
    b = DTYPE_BYTES
    layers = math.ceil(shape.layers / layout.pp)
    moe_layers = math.ceil(shape.moe_layers / layout.pp)
    mlp = (layers - moe_layers) * shape.mlp_params_per_rank(layout.tp) + moe_layers * (
        shape.mlp_params_per_rank(layout.tp, layout.ep, moe=True)
    )
    vocab = shape.vocab_per_rank(layout.tp) * shape.hidden
    embed = vocab * (2 if not shape.tied and layout.pp == 1 else 1)  # the embedding and the LM head
    weights_b = (layers * shape.attention_params_per_rank(layout.tp) + embed) * b[work.weight_dtype] + mlp * b[
        work.mlp_dtype or work.weight_dtype
    ]
    seq_tokens = math.ceil((work.prompt_len + work.gen_len) / layout.cp)
    micro = math.ceil(work.batch / micro_batches(work.batch, layout.pp))
    kv = (
        micro_batches(work.batch, layout.pp)
        * micro
        * seq_tokens
        * shape.kv_bytes_per_token(layout.tp, layers, b[work.kv_dtype])
    )
    rows = micro * math.ceil(work.prompt_len / layout.cp)
    q_heads, kv_heads = shape.heads_per_rank(layout.tp)
    act_row = (4 * shape.hidden + (q_heads + 2 * kv_heads) * shape.head_dim) * b[work.act_dtype]
    mlp_rows = min(rows, MLP_ROW_CHUNK)  # a long prefill's MLP runs in slices of this many rows
    act = rows * act_row + mlp_rows * 3 * max_shard(shape.intermediate, layout.tp) * b[work.act_dtype]
    if layout.cp > 1:  # the ring's two K/V receive buffers and fp32 accumulators
        act += (
            2 * rows * shape.kv_bytes_per_token(layout.tp, 1, b[work.kv_dtype])
            + rows * q_heads * (shape.head_dim + 1) * 4
        )
    mem = {
        "weights": weights_b / GIB,
        "kv_cache": kv / GIB,
        "activations": act / GIB,
        "runtime": hw.base_memory_bytes / GIB,
    }
    if hw.device == "cpu":
        act_b = b[work.act_dtype]
        messages = {
            "tp": (
                rows * shape.hidden * act_b,
                micro * shape.hidden * act_b,
                micro * shape.vocab_per_rank(layout.tp) * 4,
            ),  # hidden states, the LM head's logits
            "cp": (micro * q_heads * (shape.head_dim + 1) * 4,),
        }  # a decode's partials and LSEs
        mem["comm_buffers"] = (
            sum(
                shm_segment_bytes(getattr(layout, axis), sizes)
                for axis, sizes in messages.items()
                if not group_placement(layout, axis, ranks_per_node or layout.ranks)[0]
            )
            / GIB
        )
    return mem


def shm_segment_bytes(group_size: int, messages) -> float:
    """Bytes of a node-local group's shared segment (comm/shm.py) in each rank's resident memory:
    an op writes its tensor into this rank's slot of one of NBUF buffers in turn and reads every
    rank's slot, so the largest tensor that fits a slot is resident NBUF x group_size times (as a long
    prompt's tp=2 prefill's peak RSS per rank against --shm off bore out)."""
    fitting = [m for m in messages if 0 < m <= DEFAULT_SLOT_BYTES]
    return NBUF * group_size * max(fitting) if group_size > 1 and fitting else 0.0

"""A step through all of a stage's layers in one native call (kernels/decode_stack.c).

At batch 1 on the CPU the layer-by-layer path spends about as long between its native kernels
(the interpreter, torch's dispatch, ~15 calls a layer) as in them; the fused call runs the same
kernels back to back in C (docs/benchmarks.md, "Weights that stay quantized"). A step with prompt
chunks (beside decodes or not) runs there too, its products through a GEMM library (kernels/gemm.py) on weights
dequantized a cache-sized panel at a time (kernels/decode_stack.c says when whole), a chunk's
attention as two GEMMs per head: layer by layer, every step paid the interpreter's dispatch and a
write-out of every dequantized weight, so a prompt cut into small chunks to keep decodes flowing
cost far more than whole (docs/benchmarks.md, "Mixed steps in one native call"). It serves the plain case only, and anything else goes the
layer-by-layer way: up to MAX_ROWS rows (MAX_STACK_ROWS with a GEMM), fp32 on the CPU with the native
kernels, no context parallelism or token split, Llama layers with a dense MLP and no biases, every
linear fp32 or the native quantized form. Under tp each layer's two halves are a call each, with
the all-reduces between them, and a ladder stage (models/ladder.py) runs its halves with the
ladder's wiring at any tp. The results are the layer-by-layer path's within fp32 rounding (the
activation's exp is the kernels' own, the products' summation order the GEMM's at each size):
tests/unit/models/test_fused_decode.py holds them together and to transformers. Under
`--prompt-dtype bfloat16` (prompt_bf16) the rows of a step that are prompt tokens
(`meta.prompt_rows`) take their products in bf16 (tests/unit/models/test_fused_decode_bf16.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from loguru import logger

from dist_infer.kernels import MAX_ROWS, CpuKernels, kernels_if_cpu_fp32
from dist_infer.kernels.decode_stack import DecodeStackPlan, StackLayer, StackLinear
from dist_infer.kernels.gemm import cpu_bf16_instructions
from dist_infer.models.attention_metadata import AttentionMetadata
from dist_infer.models.ladder import Ready
from dist_infer.parallel.linear import QKVParallelLinear
from dist_infer.parallel.quantized_linear import GroupQuantLinear
from dist_infer.parallel.token_split import InFlight
from dist_infer.parallel.tp_comm import reduce_from_tp


def _linear(layer) -> Optional[StackLinear]:
    """What the kernels read of a parallel linear, or None where they cannot (a bias, another packing)."""
    if getattr(layer, "bias", None) is not None:
        return None
    packed = layer.quantized
    if packed is None:
        w = layer.weight
        if w is None or w.dtype != torch.float32 or not w.is_contiguous():
            return None
        return StackLinear(w, int(w.shape[0]), int(w.shape[1]))
    if type(packed) is not GroupQuantLinear or packed.group_size % 32:
        return None
    return StackLinear(
        packed.q, packed.out_features, packed.in_features, packed.scales, packed.zeros, packed.group_size, packed.bits
    )


def _stack_layer(layer, kv) -> Optional[StackLayer]:
    from dist_infer.models.llama import LlamaDecoderLayer, LlamaMLP  # the layer types this serves (no cycle at import)

    if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn.qkv_proj) is not QKVParallelLinear or not (
        attn.o_proj.reduce_results and mlp.down_proj.reduce_results
    ):
        return None
    parts = [_linear(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(p is None for p in parts) or any(n.dtype != torch.float32 for n in norms):
        return None
    k_cache, v_cache = kv
    if (
        not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or kernels_if_cpu_fp32(attn.kernels, k_cache, v_cache) is None
    ):
        return None
    return StackLayer(norms[0], norms[1], *parts, k_cache.data_ptr(), v_cache.data_ptr())


def _plan(stage, kv_caches: list) -> Optional[DecodeStackPlan]:
    layers = [_stack_layer(layer, kv) for layer, kv in zip(stage.layers, kv_caches)]
    if not layers or any(L is None for L in layers):
        return None
    first = stage.layers[0]
    attn, norm = first.self_attn, first.input_layernorm
    if any(
        layer.input_layernorm.eps != norm.eps or layer.post_attention_layernorm.eps != norm.eps
        for layer in stage.layers
    ):
        return None
    return DecodeStackPlan(
        layers,
        attn.q_heads,
        attn.kv_heads,
        attn.head_dim,
        stage.cfg.hidden_size,
        layers[0].down.k,
        norm.eps,
        attn.scale,
    )


def _kernels(stage) -> Optional[CpuKernels]:
    """The kernels every layer was given, or None (not given, or not the same everywhere)."""
    first = stage.layers[0].self_attn.kernels
    if first is None:
        return None
    for layer in stage.layers:
        for m in (
            layer.self_attn,
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
            layer.input_layernorm,
            layer.post_attention_layernorm,
        ):
            if getattr(m, "kernels", None) is not first:
                return None
    return first


@dataclass
class DecodeStackCache:
    """A stage's plan (None: its layers are not served), with the kernels and cache addresses it was
    made for."""

    key: tuple
    plan: Optional[DecodeStackPlan]


MAX_STACK_ROWS = 4096  # a step of more rows (a long prompt's whole chunk) goes layer by layer: its work
# buffers are ~34 KB a row on the default model (a chunk's attention takes blocks of 64 rows, so its
# scores stay small); the serve budget (2048 tokens) fits, so bf16 prompts stay bf16 however chunked


def fused_decode(stage, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list) -> Optional[torch.Tensor]:
    """The hidden states after every layer of `stage`, every row of the step ([T, H]), or None where
    the fused call does not serve it (the caller then runs the layers one by one). A decode step of
    up to MAX_ROWS sequences runs on the skinny kernels; any other step (prompt chunks, beside
    decodes or not) of up to MAX_STACK_ROWS rows where a GEMM was found (`kernels.sgemm`)."""
    kernels = stage.layers[0].self_attn.kernels if stage.native_decode_stack and len(stage.layers) else None
    rows = x.shape[0] if x.dim() == 2 else 0
    if (
        kernels is None
        or meta.cp is not None
        or meta.seq_lens_t is None
        or x.shape[-1] != stage.input_width
        or not 1 <= rows <= (MAX_ROWS if kernels.sgemm is None else MAX_STACK_ROWS)
        or (meta.decode and rows != meta.batch)
        or x.dtype != torch.float32
        or x.device.type != "cpu"
    ):
        return None
    key = (kernels, tuple((k.data_ptr(), v.data_ptr()) for k, v in kv_caches[: len(stage.layers)]))
    cached = stage.decode_stack_cache
    if cached is None or cached.key != key:
        plan = _plan(stage, kv_caches)  # first: it checks the layers' types, which _kernels then walks
        cached = DecodeStackCache(key, plan if plan is not None and _kernels(stage) is kernels else None)
        stage.decode_stack_cache = cached
    plan = cached.plan
    if plan is None:
        return None
    cos, sin = stage.rotary.cos_sin(meta.positions)
    tables, seq_lens, runs = _row_queries(meta)
    bf16_rows = meta.prompt_rows if stage.prompt_bf16 else None
    step = kernels.decode_step(
        plan,
        rows,
        cos,
        sin,
        meta.slot_mapping,
        tables,
        seq_lens,
        meta.window,
        kv_caches[0][0].shape[1],
        runs,
        bf16_rows,
    )
    if stage.tp.size == 1 and not stage.ladder.active:
        return kernels.decode_stack(plan, step, x)
    return _layer_halves(stage, kernels, plan, step, x)


def _row_queries(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Each row's block table, the keys it sees (its position + 1) and each sequence's rows (None: a
    row each), the kernels' view of a step: in a decode step the sequences' own; in a prompt chunk
    every row sees the chunk's keys up to its own (causal), all written before any row attends."""
    if meta.decode:
        return meta.block_tables, meta.seq_lens_t, None
    lens = torch.tensor(meta.query_lens, dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(meta.query_lens)), lens)
    runs = torch.zeros(len(meta.query_lens) + 1, dtype=torch.long)
    torch.cumsum(lens, 0, out=runs[1:])
    return meta.block_tables.index_select(0, owner), meta.positions + 1, runs


def _layer_halves(stage, kernels: CpuKernels, plan: DecodeStackPlan, step, x: torch.Tensor) -> torch.Tensor:
    """Each layer's two halves in C, the all-reduce of each half's partial sum between them (as
    o_proj's and down_proj's `finish` would do it), with run_ladder_stage's wiring (models/ladder.py)
    in a ladder range: there a layer's attention half adds the previous attention's output (its
    all-reduce waited only now) and posts its own, its MLP half the same with the previous MLP's."""
    lp, hidden, tp = stage.ladder, stage.cfg.hidden_size, stage.tp
    attn = mlp = None  # the pending outputs of the range's last attention and MLP (InFlight or Ready)
    if lp.carries_in:
        x, mlp = x[:, :hidden].contiguous().clone(), Ready(x[:, hidden:].contiguous())
    else:
        x = x.contiguous().clone()
    pending = None  # a standard layer's reduced MLP output, added by the next half
    for i in range(len(plan.layers)):
        if i in lp.local:
            if pending is not None:  # the standard layer before the range: its MLP output joins now
                x.add_(pending)
                pending = None
            halves = [attn, mlp]
            for part in (0, 1):
                out = torch.empty_like(x)
                kernels.decode_layer_part(plan, step, i, part, x, halves[part].result() if halves[part] else None, out)
                halves[part] = InFlight(tp, out, _no_bias)
            attn, mlp = halves
            continue
        if attn is not None:  # the range ended at the layer before
            x.add_(attn.result()).add_(mlp.result())
            attn = mlp = None
        for part in (0, 1):
            out = torch.empty_like(x)
            kernels.decode_layer_part(plan, step, i, part, x, pending, out)
            reduce_from_tp(out, tp)
            pending = out
    if attn is None:
        return x if pending is None else x.add_(pending)
    if lp.carries_out:
        return torch.cat([x.add_(attn.result()), mlp.result()], dim=-1)
    return x.add_(attn.result()).add_(mlp.result())


def _no_bias(y: torch.Tensor) -> torch.Tensor:
    return y  # what follows a reduce: the fused layers have no bias to add


def prompt_bf16(flag: str, stage) -> bool:
    """--prompt-dtype for `stage`: whether its prompt tokens' products run in bf16 (fused_decode).
    bfloat16 where it cannot is an error naming why; auto then says why it stays float32."""
    if flag == "float32":
        return False
    instructions = cpu_bf16_instructions()
    why = _no_bf16_prompts(stage, instructions)
    if why is None:
        logger.info(f"--prompt-dtype {flag}: prompt tokens' products in bf16 ({', '.join(instructions)})")
        return True
    if flag == "bfloat16":
        raise ValueError(f"--prompt-dtype bfloat16: {why}")
    logger.info(f"--prompt-dtype auto: prompts in float32, as {why}")
    return False


def _no_bf16_prompts(stage, instructions: list[str]) -> Optional[str]:
    """Why `stage` cannot run bf16 prompts on a CPU with these bf16 `instructions`, or None where it can."""
    first = stage.layers[0] if len(stage.layers) else None
    if first is None:
        return "this stage has no layers"
    weight = first.input_layernorm.weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"the model is {weight.dtype} on {weight.device.type}: bf16 prompts are for float32 on the CPU"
    kernels = first.self_attn.kernels
    if kernels is None or not stage.native_decode_stack:
        return "the native kernels' one-call step is off here (--native-kernels, or no C compiler)"
    if kernels.gemm_bf16 is None:
        return "oneDNN's bf16 GEMM does not load (the onednn-cpu-gomp wheel)"
    if not instructions:
        return "this CPU has no bf16 matrix instructions (amx_bf16, avx512_bf16 in /proc/cpuinfo)"
    return None

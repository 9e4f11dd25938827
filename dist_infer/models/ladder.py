"""Ladder Residual (Zhang, Mishra et al., arXiv 2501.06589) for the decoder layers of a LlamaStage.

A ladder layer adds its attention and MLP outputs to the residual stream one module later, so the
tensor-parallel all-reduce of each module runs while the next module computes:

    residual = residual + prev_attn            # the previous attention's all-reduce is waited here
    attn_out = attn(input_layernorm(residual))                   # all-reduce posted, not waited
    residual = residual + prev_mlp             # the previous MLP's all-reduce is waited here
    mlp_out = mlp(post_attention_layernorm(residual))            # all-reduce posted, not waited

and after the range's last layer: residual + attn_out + mlp_out. Layers outside [FIRST, LAST]
(ModelConfig.ladder_layers) are standard. Under tp=1 it is the same math with no communication.

Pipeline stages: a stage ending inside the range hands over residual + attn_out (the next layer's
first add, done early) and mlp_out, concatenated as [T, 2H]; a stage starting inside the range
takes that (its `input_width` says 2H) and starts with mlp_out pending, so the model is the same
function for every pp split. A ladder stage runs without token splitting and sequence parallelism
(the step's full metadata; the ladder does its own overlap); context parallelism is refused.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dist_infer.models.config import ModelConfig
from dist_infer.parallel.token_split import InFlight


class LadderError(ValueError):
    """A layout the ladder forward does not run."""


class Ready:
    """A branch output already reduced (handed over by the previous pipeline stage)."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value


class LadderPlan:
    """Which of a stage's layers are ladder layers, and what crosses its pipeline boundaries."""

    def __init__(self, cfg: ModelConfig, layer_ids: range, cp_size: int = 1):
        span = cfg.ladder_layers
        self.local = frozenset(i for i, g in enumerate(layer_ids) if span and span[0] <= g <= span[1])
        self.active = bool(self.local)
        # open at a boundary: the range runs across it (a layer on each side is a ladder layer)
        self.carries_in = bool(span and len(layer_ids) and span[0] < layer_ids[0] <= span[1])
        self.carries_out = bool(span and len(layer_ids) and span[0] <= layer_ids[-1] < span[1])
        self.input_width = cfg.hidden_size * (2 if self.carries_in else 1)
        if self.active and cp_size > 1:
            raise LadderError(
                f"--ladder-residual (layers {span[0]}:{span[1]}) with --cp {cp_size} is not "
                f"supported: use --cp 1 or --ladder-residual off"
            )


def mlp_partial(mlp: nn.Module, x: torch.Tensor):
    """The MLP of `x` up to its tp all-reduce, and what follows the reduce: (partial sum, finish).
    A dense LlamaMLP finishes with down_proj's bias; the expert MLP has none (its partial sum is
    already gathered over ep)."""
    down = getattr(mlp, "down_proj", None)
    return mlp.partial(x), (down.add_bias if down is not None else (lambda y: y))


def ladder_layer(
    layer: nn.Module,
    residual: torch.Tensor,
    prev_attn,
    prev_mlp,
    cos,
    sin,
    kv,
    meta,
    rows: Optional[torch.Tensor] = None,
):
    """One ladder layer: -> (residual, attention pending, MLP pending). `prev_attn` / `prev_mlp`:
    the previous layer's pending outputs (None: nothing pending). `rows`: keep only these tokens
    after attention (the model's last layer; every token's keys still go to the cache)."""
    attn = layer.self_attn
    tp = attn.o_proj.tp
    if prev_attn is not None:
        residual = residual + prev_attn.result()
    normed = layer.input_layernorm(residual)
    h = None
    if rows is not None and rows is meta.last_token_index:
        h = attn.attend_last_tokens(normed, cos, sin, kv, meta)
    if h is None:
        h = attn.attend(normed, cos, sin, kv, meta)
        if rows is not None:
            h = h[rows]
    attn_out = InFlight(tp, attn.o_proj.partial(h), attn.o_proj.add_bias)
    if rows is not None:
        residual = residual[rows]
    if prev_mlp is not None:
        m = prev_mlp.result()
        residual = residual + (m if rows is None else m[rows])
    mlp_out = InFlight(tp, *mlp_partial(layer.mlp, layer.post_attention_layernorm(residual)))
    return residual, attn_out, mlp_out


def run_ladder_stage(stage: nn.Module, x: torch.Tensor, meta, kv_caches: list, trim: bool) -> torch.Tensor:
    """The stage's layers on `x` (embedded tokens, or the previous stage's hand-over) with
    `stage.ladder`'s layers laddered; the hidden states out ([T, 2H] when the range runs on into
    the next stage). `trim`: the last layer keeps each sequence's last token only."""
    plan: LadderPlan = stage.ladder
    hidden = stage.cfg.hidden_size
    attn = mlp = None
    if plan.carries_in:
        if x.shape[-1] != 2 * hidden:
            raise LadderError(
                f"a stage starting inside the ladder range takes [T, {2 * hidden}] "
                f"(residual, pending MLP output), got {tuple(x.shape)}"
            )
        x, mlp = x[:, :hidden].contiguous(), Ready(x[:, hidden:].contiguous())
    cos, sin = stage.rotary.cos_sin(meta.positions)
    last = len(stage.layers) - 1
    for i, layer in enumerate(stage.layers):
        rows = meta.last_token_index if trim and i == last else None
        if i in plan.local:
            x, attn, mlp = ladder_layer(layer, x, attn, mlp, cos, sin, kv_caches[i], meta, rows)
            continue
        if attn is not None:  # the range ended at the layer before
            x, attn, mlp = x + attn.result() + mlp.result(), None, None
        x = layer(x, cos, sin, kv_caches[i], meta, rows)
    if attn is None:
        return x
    if plan.carries_out:
        return torch.cat([x + attn.result(), mlp.result()], dim=-1)
    return x + attn.result() + mlp.result()

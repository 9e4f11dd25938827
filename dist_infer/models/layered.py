"""A stage's forward for a step with one prompt in the middle of its layers (layered prefill:
engine/layered_prefill.py).

The step's other sequences (decodes, short prompts) run every layer; the layered one joins them
only for its group of layers [first, end): before it, its hidden states come from the stash its
previous group left (or from the embedding, for the first group); after it, they go back to the
stash, or, after the model's last layer, on to the LM head. Inside the group the two run as one
batch, so the group's weights (an MoE layer's experts) are read once for both. Every rank keeps
its own copy of the stash (the hidden states are replicated over tp and ep, like the residual
stream), and the engine drops it when the plan frees the sequence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from dist_infer.models.attention_metadata import AttentionMetadata


class LayeredStepError(ValueError):
    """A plan's layered prefill this stage cannot run (bad layers, hidden states it does not have)."""


@dataclass
class LayeredStep:
    """A step's metadata when one of its sequences runs only layers [first, end)."""

    full: AttentionMetadata  # every sequence of the step (the group's layers)
    others: Optional[AttentionMetadata]  # every sequence but the layered one; None: it runs alone
    other_rows: Optional[torch.Tensor]  # the others' rows in the step's tokens
    rows: tuple[int, int]  # the layered sequence's rows [a, b) in the step's tokens
    index: int  # its index among the step's sequences
    seq_id: int
    first: int
    end: int
    stash: dict  # seq id -> hidden states [tokens, H] between groups (the worker's, on every rank)

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "LayeredStep":
        return dataclasses.replace(
            self,
            full=self.full.moved(move),
            others=None if self.others is None else self.others.moved(move),
            other_rows=None if self.other_rows is None else move(self.other_rows),
        )


def _run_layers(
    stage, x: Optional[torch.Tensor], meta: Optional[AttentionMetadata], kv_caches, layers: range
) -> Optional[torch.Tensor]:
    """Layers `layers` of `stage` on `x`; the model's last layer keeps each sequence's last token
    only (LlamaDecoderLayer.forward's `rows`)."""
    if x is None or not len(layers):
        return x
    cos, sin = stage.rotary.cos_sin(meta.positions)
    last = len(stage.layers) - 1
    for i in layers:
        rows = meta.last_token_index if i == last and x.shape[0] > meta.batch else None
        x = stage.layers[i](x, cos, sin, kv_caches[i], meta, rows)
    return x


def run_layered_stage(stage, x: torch.Tensor, step: LayeredStep, kv_caches) -> torch.Tensor:
    """The step on a whole model (pp=1): `x` the embedded tokens [T, H] -> the last token's hidden
    state of each sequence [B, H], in plan order (zeros for a layered sequence not at its end yet)."""
    num_layers = len(stage.layers)
    a, b = step.rows
    mine = x[a:b] if step.first == 0 else step.stash.pop(step.seq_id)  # (check_layered made sure it is there)
    others = None if step.others is None else x[step.other_rows]
    others = _run_layers(stage, others, step.others, kv_caches, range(0, step.first))
    joined = mine if others is None else torch.cat([others[:a], mine, others[a:]])
    joined = _run_layers(stage, joined, step.full, kv_caches, range(step.first, step.end))
    if step.end == num_layers:
        return joined
    step.stash[step.seq_id] = joined[a:b]
    if others is None:
        return joined.new_zeros(1, joined.shape[1])
    others = _run_layers(
        stage, torch.cat([joined[:a], joined[b:]]), step.others, kv_caches, range(step.end, num_layers)
    )
    pad = others.new_zeros(1, others.shape[1])
    return torch.cat([others[: step.index], pad, others[step.index :]])


def check_layered(step: LayeredStep, num_layers: int) -> None:
    """What would otherwise fail on every rank mid-forward: layers out of range, a group after the
    first without the hidden states the previous one left."""
    if not 0 <= step.first < step.end <= num_layers:
        raise LayeredStepError(f"sequence {step.seq_id}: layers [{step.first}, {step.end}) of a model of {num_layers}")
    if step.first > 0 and step.seq_id not in step.stash:
        raise LayeredStepError(f"sequence {step.seq_id}: no hidden states kept for its layers from {step.first}")

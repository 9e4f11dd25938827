"""Layered prefill ("From Tokens to Layers: Redefining Stall-Free Scheduling for LLM Serving with
Layered Prefill"): a prompt too long for one step's token budget advances through one contiguous
group of layers per step, whole, instead of through every layer in token chunks, while the step's
decodes run through every layer.

Chunked prefill cuts a prompt along tokens, so every chunk reads every layer's weights again: an
MoE layer's experts are loaded once per chunk. Cut along layers, each layer (each expert) is read
once per prompt. A step's prompt work is its tokens times the fraction of the layers it runs, and
that is what the token budget counts. The hidden states between groups stay on every rank
(models/layered.py); the request's blocks are all taken when its first group runs, and its tokens
count as computed (registered in the prefix cache, sent by a migration) only after the last.

At most one prompt is in its layers at a time (it is the step's prompt work); a preempted or
aborted one starts again from scratch; a migration waits for its last group (engine/migration.py).
Pure bookkeeping, tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SCHEDULES = ("chunked", "layered")


@dataclass(frozen=True)
class LayeredPrefill:
    """The schedule's settings: the model's layers, and the groups a prompt is cut into (None:
    the fewest that keep each step's share of the prompt within the step's token budget)."""

    num_layers: int
    groups: Optional[int] = None

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"layered prefill needs a model with layers, got {self.num_layers}")
        if self.groups is not None and not 1 <= self.groups:
            raise ValueError(f"--layer-groups must be at least 1, got {self.groups}")

    def groups_for(self, tokens: int, budget: float) -> int:
        """Groups for a prompt of `tokens` beside `budget` tokens of room (at most one per layer)."""
        if self.groups is not None:
            return min(self.groups, self.num_layers)
        if budget == float("inf") or budget <= 0:
            return self.num_layers if budget <= 0 else 1
        return max(1, min(self.num_layers, -(-tokens // int(budget))))


def group_bounds(num_layers: int, groups: int, index: int) -> tuple[int, int]:
    """Layers [first, end) of group `index` of `groups` near-equal contiguous groups (the first
    `num_layers % groups` groups one layer longer)."""
    if not 0 <= index < groups <= num_layers:
        raise ValueError(f"group {index} of {groups} over {num_layers} layers")
    base, extra = divmod(num_layers, groups)
    first = index * base + min(index, extra)
    return first, first + base + (1 if index < extra else 0)


def group_charge(tokens: int, first: int, end: int, num_layers: int) -> int:
    """What one group's step counts against the token budget: the prompt's tokens times the
    fraction of the layers it runs (rounded up; at least 1)."""
    return max(1, -(-tokens * (end - first) // num_layers))


@dataclass
class LayerProgress:
    """A prompt in the middle of its layers: `tokens` new tokens from `start`, cut into `groups`
    groups, of which `done` have run (their steps launched)."""

    start: int
    tokens: int
    groups: int
    done: int = 0

    def next_bounds(self, num_layers: int) -> tuple[int, int]:
        return group_bounds(num_layers, self.groups, self.done)

    @property
    def last(self) -> bool:
        """The next group is the last: its step samples the prompt's first token."""
        return self.done + 1 == self.groups

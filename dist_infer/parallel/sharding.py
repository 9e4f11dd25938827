"""The arithmetic of sharding: which slice of a full tensor or which heads a rank owns.

Pure functions, unit tested without processes. Errors show the numbers that don't divide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


class ShardingError(ValueError):
    """A model dimension that the requested parallel size cannot split."""


def shard_range(total: int, parts: int, index: int, what: str = "dimension") -> tuple[int, int]:
    """(start, length) of shard `index` when `total` is split evenly into `parts`."""
    if total % parts:
        raise ShardingError(f"{what} {total} is not divisible by {parts} ({total} % {parts} = {total % parts})")
    size = total // parts
    return index * size, size


def padded_shard_range(total: int, parts: int, index: int) -> tuple[int, int, int]:
    """(start, padded length, valid length) for a dimension that need not divide (the vocabulary)."""
    size = -(-total // parts)
    start = index * size
    return start, size, max(0, min(size, total - start))


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads one tensor-parallel rank owns.

    Query heads are split evenly. KV heads are split when tp divides them; when tp exceeds
    them, each KV head is replicated on tp / kv_heads consecutive ranks (vLLM's rule), so every
    rank holds exactly the KV head its query heads read.
    """

    num_heads: int
    num_kv_heads: int
    tp: int
    rank: int

    def __post_init__(self):
        h, kv, tp = self.num_heads, self.num_kv_heads, self.tp
        if h % kv:
            raise ShardingError(f"num_attention_heads {h} is not a multiple of num_key_value_heads {kv}")
        if h % tp:
            raise ShardingError(f"num_attention_heads {h} is not divisible by tp={tp} ({h} % {tp} = {h % tp})")
        if kv % tp and tp % kv:
            raise ShardingError(
                f"num_key_value_heads {kv} and tp={tp}: tp must divide the KV heads or be a multiple of them"
            )

    @property
    def q_heads(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    @property
    def q_start(self) -> int:
        return self.rank * self.q_heads

    @property
    def kv_start(self) -> int:
        if self.tp <= self.num_kv_heads:
            return self.rank * self.kv_heads
        return self.rank // (self.tp // self.num_kv_heads)


def balanced_partition(num_layers: int, stages: int) -> list[int]:
    """Layers per pipeline stage, as even as possible; spare layers go to the middle stages,
    then the first: the last stage also runs the LM head, often worth several layers."""
    if stages > num_layers:
        raise ShardingError(f"pp={stages} stages for {num_layers} layers: every stage needs at least one layer")
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    order = list(range(1, stages - 1)) + [0, stages - 1]
    for i in range(extra):
        counts[order[i % len(order)]] += 1
    return counts


def stage_layers(num_layers: int, stages: int, stage: int, split: Optional[Sequence[int]] = None) -> range:
    """The layer indices of pipeline `stage`; `split` (layers per stage) overrides the balance."""
    if split is not None:
        split = list(split)
        if len(split) != stages or sum(split) != num_layers or min(split) < 1:
            raise ShardingError(
                f"pipeline split {split} must give {stages} positive layer counts summing to {num_layers} "
                f"(sums to {sum(split)})"
            )
        counts = split
    else:
        counts = balanced_partition(num_layers, stages)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])

"""The arithmetic of sharding: which slice of a full tensor or which heads a rank owns.

Pure functions, unit tested without processes. Errors show the numbers that don't divide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


class ShardingError(ValueError):
    """A model dimension that the requested parallel size cannot split."""


def shard_range(total: int, parts: int, index: int, what: str = "dimension") -> tuple[int, int]:
    """(start, length) of shard `index` when `total` is split into `parts` as evenly as it goes:
    the first `total % parts` shards hold one more (9 over 2: 5 + 4). Tensor parallelism needs no
    even split, only the all-reduce of every shard's partial sum; an empty shard is an error."""
    if not 0 <= index < parts:
        raise ShardingError(f"{what}: shard {index} of {parts} does not exist")
    if parts > total:
        raise ShardingError(f"{what} {total} cannot be split over {parts} ranks: every rank needs at least one")
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def padded_shard_range(total: int, parts: int, index: int) -> tuple[int, int, int]:
    """(start, padded length, valid length) for a dimension that need not divide (the vocabulary)."""
    size = -(-total // parts)
    start = index * size
    return start, size, max(0, min(size, total - start))


def _head_ranges(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[int, int, int, int]:
    """(q_start, q_heads, kv_start, kv_heads) of one rank; see `HeadLayout`."""
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:  # whole KV heads per rank, each with all of its query heads
        kv_start, kv_heads = shard_range(num_kv_heads, tp, rank, "num_key_value_heads")
        return kv_start * group, kv_heads * group, kv_start, kv_heads
    for kv in range(num_kv_heads):  # one KV head per rank, on a balanced number of consecutive ranks
        first, ranks = shard_range(tp, num_kv_heads, kv)
        if first <= rank < first + ranks:
            q_start, q_heads = shard_range(group, ranks, rank - first, "query heads per KV head")
            return kv * group + q_start, q_heads, kv, 1
    raise AssertionError("unreachable: every rank falls in one KV head's range")


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads one tensor-parallel rank owns.

    tp <= KV heads: the KV heads are split as evenly as they go and each rank takes the query
    heads that read them (9 / 3 heads at tp=2: 6 + 3 query heads, 2 + 1 KV heads), so no KV head
    is stored twice. tp > KV heads: each KV head is replicated on a balanced run of consecutive
    ranks, which split its query heads (vLLM's rule when tp is a multiple of the KV heads, and
    the same idea when it is not). vLLM and DeepSpeed refuse sizes that do not divide the heads;
    the all-reduce after o_proj does not care how many heads a rank holds.
    """

    num_heads: int
    num_kv_heads: int
    tp: int
    rank: int

    def __post_init__(self):
        h, kv, tp = self.num_heads, self.num_kv_heads, self.tp
        if kv < 1 or h % kv:
            raise ShardingError(f"num_attention_heads {h} is not a multiple of num_key_value_heads {kv}")
        if tp > h:
            raise ShardingError(
                f"num_attention_heads {h} cannot be split over tp={tp}: every rank needs at least one query head"
            )
        q_start, q_heads, kv_start, kv_heads = _head_ranges(h, kv, tp, self.rank)
        object.__setattr__(self, "_ranges", (q_start, q_heads, kv_start, kv_heads))

    @property
    def q_start(self) -> int:
        return self._ranges[0]

    @property
    def q_heads(self) -> int:
        return self._ranges[1]

    @property
    def kv_start(self) -> int:
        return self._ranges[2]

    @property
    def kv_heads(self) -> int:
        return self._ranges[3]


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

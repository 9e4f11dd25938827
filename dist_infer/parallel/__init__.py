"""Parallel layers: tensor parallel (column, row, QKV, vocab), pipeline stages.

The names below are imported on first use (PEP 562), so the torch-free modules here
(`sharding`, `overlap_policy`, which the planner uses) load without torch."""

from importlib import import_module

_WHERE = {
    "ColumnParallelLinear": "linear",
    "MergedColumnParallelLinear": "linear",
    "QKVParallelLinear": "linear",
    "RowParallelLinear": "linear",
    "ParallelLMHead": "embedding",
    "VocabParallelEmbedding": "embedding",
    "HeadLayout": "sharding",
    "ShardingError": "sharding",
    "balanced_partition": "sharding",
    "shard_range": "sharding",
    "stage_layers": "sharding",
    "WeightShapeError": "weights",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"dist_infer.parallel.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dist_infer.parallel' has no attribute {name!r}")

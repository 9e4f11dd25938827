"""Parallel layers: tensor parallel (column, row, QKV, vocab), pipeline stages."""

from dist_infer.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from dist_infer.parallel.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from dist_infer.parallel.sharding import HeadLayout, ShardingError, balanced_partition, shard_range, stage_layers
from dist_infer.parallel.weights import WeightShapeError

__all__ = [
    "ColumnParallelLinear", "HeadLayout", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear",
    "RowParallelLinear", "ShardingError", "VocabParallelEmbedding", "WeightShapeError", "balanced_partition",
    "shard_range", "stage_layers",
]

"""Model shapes: parameter counts by hand, against Llama 3 405B's published size and a real
checkpoint (each weight matrix once), heads and shards per rank as the engine splits them, and
causal attention's FLOPs."""

from __future__ import annotations

import math

import pytest
from safetensors import safe_open

from dist_infer.planner.plan import model_shape
from dist_infer.planner.shapes import ModelShape, causal_attention_flops
from tests.support.checkpoints import write_hf_checkpoint
from tests.support.plan_profiles import LLAMA3_405B, SMALL


def test_parameter_counts_by_hand():
    assert SMALL.attention_params() == 64 * 4 * 16 * 2 + 64 * 2 * 16 * 2  # q, o; k, v
    assert SMALL.dense_mlp_params() == 3 * 64 * 128
    assert SMALL.total_params() == 4 * (12288 + 24576) + 2 * 100 * 64
    # Llama3-405B, the published size
    assert LLAMA3_405B.total_params() == pytest.approx(405.8e9, rel=1e-3)


def test_parameter_count_equals_a_real_checkpoint(tmp_path):
    """Every weight matrix of a transformers checkpoint (norms aside) is counted exactly once."""
    path = write_hf_checkpoint(tmp_path, "llama-gqa")
    shape, _ = model_shape(str(path))
    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if "norm" not in name:
                total += math.prod(f.get_slice(name).get_shape())
    assert shape.total_params() == total


def test_heads_and_shards_per_rank_follow_the_engine_split():
    smol = ModelShape(
        hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152, tied=True
    )
    assert smol.heads_per_rank(1) == (9, 3)
    assert smol.heads_per_rank(2) == (6, 2)  # 6 + 3 query heads, 2 + 1 KV heads: the busiest rank
    assert smol.heads_per_rank(4) == (3, 1)  # tp > KV heads: one KV head each, its query heads split
    assert smol.mlp_params_per_rank(4) == 3 * 576 * 384
    assert smol.vocab_per_rank(3) == 16384
    assert smol.kv_bytes_per_token(2, 15, 4.0) == 2 * 2 * 64 * 4 * 15


def test_causal_attention_flops():
    # 3 tokens: 6 (query, key) pairs; QK and PV are 2 FLOPs per multiply-add, 2 heads of dim 8
    assert causal_attention_flops(2, 8, 3) == 4 * 8 * 2 * 6
    # 2 new tokens after 5 cached: 2*5 + 3 pairs
    assert causal_attention_flops(1, 4, 2, 5) == 4 * 4 * 13

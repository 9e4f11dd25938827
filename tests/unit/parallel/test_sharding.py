"""Sharding arithmetic, no processes: shard_range (balanced, covering each index once, errors that
name the numbers), padded_shard_range over a vocabulary, HeadLayout (every rank's query heads read
exactly the KV heads it holds: GQA, MQA, tp above the KV heads, uneven splits), and the pipeline
partitions (balanced_partition, stage_layers with an explicit split)."""

from __future__ import annotations

import pytest

from dist_infer.parallel.sharding import (
    HeadLayout,
    ShardingError,
    balanced_partition,
    padded_shard_range,
    shard_range,
    stage_layers,
)

# --- shard_range ---------------------------------------------------------------------------------


def test_shard_range_even_split():
    assert [shard_range(12, 4, i) for i in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    assert shard_range(7, 1, 0) == (0, 7)


def test_shard_range_uneven_split_is_balanced_and_covers_once():
    assert [shard_range(9, 2, i) for i in range(2)] == [(0, 5), (5, 4)]
    assert [shard_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 3), (7, 3)]
    for total, parts in [(1536, 7), (576, 5), (13, 13), (100, 3)]:
        ranges = [shard_range(total, parts, i) for i in range(parts)]
        assert [s for s, _ in ranges] == [sum(n for _, n in ranges[:i]) for i in range(parts)]
        assert sum(n for _, n in ranges) == total and max(n for _, n in ranges) - min(n for _, n in ranges) <= 1


def test_shard_range_error_names_the_numbers():
    with pytest.raises(ShardingError) as info:
        shard_range(3, 4, 0, "q_proj: output features")
    msg = str(info.value)
    assert "q_proj: output features 3" in msg and "4 ranks" in msg
    with pytest.raises(ShardingError, match="shard 5 of 4"):
        shard_range(8, 4, 5)


def test_padded_shard_range_covers_vocab_once():
    for vocab, tp in [(128, 3), (10, 4), (7, 7), (5, 8)]:
        seen = []
        for r in range(tp):
            start, local, valid = padded_shard_range(vocab, tp, r)
            assert local == -(-vocab // tp) and 0 <= valid <= local
            seen += list(range(start, start + valid))
        assert seen == list(range(vocab))


# --- HeadLayout ----------------------------------------------------------------------------------


def _check_layout(h: int, kv: int, tp: int) -> list[HeadLayout]:
    """Every rank's q heads read exactly the kv heads it holds, in the order SDPA's GQA expects,
    every q head is on exactly one rank, and the split is as even as the KV heads allow."""
    group = h // kv  # q heads per kv head
    layouts = [HeadLayout(h, kv, tp, r) for r in range(tp)]
    q_seen = []
    for lay in layouts:
        assert lay.q_heads >= 1 and lay.kv_heads >= 1
        assert 0 <= lay.kv_start and lay.kv_start + lay.kv_heads <= kv
        assert lay.q_heads % lay.kv_heads == 0
        local_group = lay.q_heads // lay.kv_heads  # what enable_gqa repeats each local kv head for
        for j in range(lay.q_heads):
            q_head = lay.q_start + j
            q_seen.append(q_head)
            needed_kv = q_head // group
            assert lay.kv_start + j // local_group == needed_kv, (h, kv, tp, lay.rank, j)
    assert q_seen == list(range(h)), "q heads split in order, each once"
    if tp <= kv:  # no KV head stored twice
        assert sum(lay.kv_heads for lay in layouts) == kv
    return layouts


@pytest.mark.parametrize("h,kv,tp", [(8, 4, 2), (8, 4, 4), (8, 2, 2), (4, 2, 1), (32, 8, 8)])
def test_head_layout_gqa_tp_divides_kv(h, kv, tp):
    layouts = _check_layout(h, kv, tp)
    assert [lay.kv_start for lay in layouts] == [r * (kv // tp) for r in range(tp)]
    assert all(lay.q_heads == h // tp and lay.kv_heads == kv // tp for lay in layouts)


@pytest.mark.parametrize("h,tp", [(4, 4), (8, 2), (8, 8)])
def test_head_layout_mqa(h, tp):
    layouts = _check_layout(h, 1, tp)
    assert all(lay.kv_heads == 1 and lay.kv_start == 0 and lay.q_heads == h // tp for lay in layouts)


@pytest.mark.parametrize("h,kv,tp", [(8, 2, 4), (8, 2, 8), (4, 2, 4), (16, 4, 8)])
def test_head_layout_tp_above_kv_replicates(h, kv, tp):
    layouts = _check_layout(h, kv, tp)
    for lay in layouts:
        assert lay.kv_heads == 1 and lay.q_heads == h // tp
        assert lay.kv_start == lay.q_start // (h // kv)  # the kv head its q heads use
    # each kv head sits on tp / kv consecutive ranks
    assert [lay.kv_start for lay in layouts] == [r // (tp // kv) for r in range(tp)]


def test_head_layout_uneven_smollm2_at_tp2_and_tp3():
    """SmolLM2-135M: 9 query heads, 3 KV heads. tp=2: 2 + 1 KV heads with 6 + 3 query heads."""
    two = _check_layout(9, 3, 2)
    assert [(l.q_start, l.q_heads, l.kv_start, l.kv_heads) for l in two] == [(0, 6, 0, 2), (6, 3, 2, 1)]
    three = _check_layout(9, 3, 3)
    assert [(l.q_heads, l.kv_heads) for l in three] == [(3, 1)] * 3


@pytest.mark.parametrize(
    "h,kv,tp", [(9, 3, 4), (9, 3, 5), (9, 3, 9), (4, 2, 3), (12, 4, 6), (6, 1, 4), (12, 4, 3), (10, 5, 3), (14, 7, 4)]
)
def test_head_layout_any_tp_up_to_the_query_heads(h, kv, tp):
    layouts = _check_layout(h, kv, tp)
    if tp > kv:  # each KV head on a balanced run of ranks, which split its query heads as evenly as they go
        per_kv = [sum(1 for lay in layouts if lay.kv_start == j) for j in range(kv)]
        assert max(per_kv) - min(per_kv) <= 1


def test_head_layout_errors_name_the_numbers():
    with pytest.raises(ShardingError) as info:
        HeadLayout(9, 3, 10, 0)
    assert "num_attention_heads 9" in str(info.value) and "tp=10" in str(info.value)
    with pytest.raises(ShardingError, match="not a multiple of num_key_value_heads 4"):
        HeadLayout(6, 4, 1, 0)


# --- pipeline partitions -------------------------------------------------------------------------


@pytest.mark.parametrize("layers,stages", [(2, 2), (3, 2), (10, 4), (32, 3), (7, 7), (5, 1), (13, 5)])
def test_balanced_partition(layers, stages):
    counts = balanced_partition(layers, stages)
    assert len(counts) == stages and sum(counts) == layers
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1
    extra = layers % stages
    if extra and stages > 2 and extra <= stages - 2:
        assert counts[-1] == layers // stages, "the last stage (LM head) gets no spare layer first"
    ranges = [stage_layers(layers, stages, s) for s in range(stages)]
    assert [i for r in ranges for i in r] == list(range(layers)), "stages are contiguous and cover every layer"
    assert [len(r) for r in ranges] == counts


def test_balanced_partition_examples():
    assert balanced_partition(10, 4) == [2, 3, 3, 2]
    assert balanced_partition(5, 2) == [3, 2]
    assert balanced_partition(4, 2) == [2, 2]


def test_balanced_partition_more_stages_than_layers():
    with pytest.raises(ShardingError, match="pp=3 stages for 2 layers"):
        balanced_partition(2, 3)
    with pytest.raises(ShardingError):
        stage_layers(2, 3, 0)


def test_stage_layers_explicit_split():
    assert [stage_layers(6, 3, s, [1, 2, 3]) for s in range(3)] == [range(0, 1), range(1, 3), range(3, 6)]
    assert [stage_layers(2, 2, s, (1, 1)) for s in range(2)] == [range(0, 1), range(1, 2)]


@pytest.mark.parametrize(
    "split,why", [([1, 2], "sums to 3"), ([1, 1, 1], "must give 2"), ([2, 0], "positive"), ([3, -1], "positive")]
)
def test_stage_layers_explicit_split_errors(split, why):
    with pytest.raises(ShardingError) as info:
        stage_layers(2, 2, 0, split)
    msg = str(info.value)
    assert str(split) in msg and "2" in msg
    assert why in msg or "summing to 2" in msg

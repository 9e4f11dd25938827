"""Unit tests of the tensor/pipeline-parallel building blocks, no processes started.

Sharding arithmetic (shard_range, HeadLayout, pipeline partitions), attention metadata and paged
attention against a naive fp64 reference, sampling filters, the paged KV cache, RoPE (llama3
scaling against transformers' own init function), config parsing of every supported
architecture, and the single-process library path (`api.shard` at world size 1) against HF.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from checkpoints import hf_reference, load_hf_model, write_hf_checkpoint

from dist_infer.engine.kv_cache import BlockAllocator, CacheFullError, PagedKVCache, blocks_for
from dist_infer.engine.sampling import RowSampling, SamplingParams, filter_logits, sample_rows
from dist_infer.models.attention import paged_attention
from dist_infer.models.attention_metadata import build_attention_metadata
from dist_infer.models.config import ModelConfig, ModelConfigError
from dist_infer.models.rope import Rotary, apply_rotary, inverse_frequencies
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


@pytest.mark.parametrize("h,kv,tp", [(9, 3, 4), (9, 3, 5), (9, 3, 9), (4, 2, 3), (12, 4, 6), (6, 1, 4), (12, 4, 3),
                                     (10, 5, 3), (14, 7, 4)])
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


@pytest.mark.parametrize("split,why", [([1, 2], "sums to 3"), ([1, 1, 1], "must give 2"), ([2, 0], "positive"),
                                       ([3, -1], "positive")])
def test_stage_layers_explicit_split_errors(split, why):
    with pytest.raises(ShardingError) as info:
        stage_layers(2, 2, 0, split)
    msg = str(info.value)
    assert str(split) in msg and "2" in msg
    assert why in msg or "summing to 2" in msg


# --- attention metadata --------------------------------------------------------------------------

def test_metadata_slots_positions_pad_index():
    bs = 4
    # seq 0: fresh prompt of 3; seq 1: 2 new tokens after 4 cached (positions 4, 5); seq 2: decode at position 9
    meta = build_attention_metadata([3, 2, 1], [3, 6, 10], [[5], [1, 7], [2, 0, 3]], bs)
    assert meta.positions.tolist() == [0, 1, 2, 4, 5, 9]
    assert meta.slot_mapping.tolist() == [20, 21, 22, 28, 29, 13]
    assert meta.max_q == 3 and meta.max_ctx == 10 and meta.batch == 3
    assert meta.pad_index.tolist() == [0, 1, 2, 3, 4, 6]
    assert meta.last_token_index.tolist() == [2, 4, 5]
    assert meta.block_tables.tolist() == [[5, 0, 0], [1, 7, 0], [2, 0, 3]]
    assert not meta.fresh and not meta.uniform


def test_metadata_uniform_fresh_prefill_has_no_mask():
    meta = build_attention_metadata([4, 4], [4, 4], [[0], [1]], 4)
    assert meta.fresh and meta.uniform and meta.mask is None
    assert meta.pad_index.tolist() == list(range(8))
    meta = build_attention_metadata([4, 2], [4, 2], [[0], [1]], 4)
    assert meta.fresh and meta.mask is not None  # mixed lengths need a mask


def _want_mask(q_lens, seq_lens, window=None):
    B, max_q, max_ctx = len(q_lens), max(q_lens), max(seq_lens)
    want = torch.zeros(B, max_q, max_ctx, dtype=torch.bool)
    for b, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for i in range(q):
            pos = s - q + i
            for j in range(s):
                want[b, i, j] = j <= pos and (window is None or j > pos - window)
    return want


@pytest.mark.parametrize("window", [None, 3])
def test_metadata_mask_causal_with_cached_context(window):
    q_lens, seq_lens = [3, 2, 1, 4], [3, 6, 10, 4]
    tables = [[0], [1, 2], [3, 4, 5], [6]]
    meta = build_attention_metadata(q_lens, seq_lens, tables, 4, window)
    mask = meta.mask[:, 0]
    assert mask.shape == (4, 4, 10)
    want = _want_mask(q_lens, seq_lens, window)
    for b, q in enumerate(q_lens):
        assert torch.equal(mask[b, :q], want[b, :q]), f"sequence {b}"
        assert not mask[b, :q, seq_lens[b]:].any(), "never beyond the sequence's own context"
        for i in range(q, meta.max_q):  # padded rows: exactly one key, so no NaN
            assert mask[b, i].sum() == 1


def test_metadata_sliding_window_forces_mask_on_long_prefill():
    meta = build_attention_metadata([6, 6], [6, 6], [[0, 1], [2, 3]], 4, sliding_window=4)
    assert meta.mask is not None
    assert torch.equal(meta.mask[:, 0], _want_mask([6, 6], [6, 6], 4))
    assert build_attention_metadata([3, 3], [3, 3], [[0], [1]], 4, sliding_window=4).mask is None


# --- paged attention vs naive --------------------------------------------------------------------

def _naive(q, keys, values, scale, window=None):
    """One sequence: q [n, H, d] are the last n positions of keys/values [s, KV, d]."""
    n, H, d = q.shape
    s, KV, _ = keys.shape
    rep = H // KV
    k = keys.repeat_interleave(rep, dim=1)
    v = values.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(s - n, s)[:, None]
    kpos = torch.arange(s)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, H * d)


class _PagedRun:
    """Sequences growing step by step in a shuffled paged cache, checked against _naive."""

    def __init__(self, H, KV, d, block_size=4, num_blocks=32, window=None, seed=0):
        self.H, self.KV, self.d, self.bs, self.window = H, KV, d, block_size, window
        self.gen = torch.Generator().manual_seed(seed)
        self.k_cache = torch.zeros(num_blocks, block_size, KV, d, dtype=torch.float64)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()  # non-contiguous tables
        self.tables, self.hist_k, self.hist_v = {}, {}, {}
        self.scale = d ** -0.5

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def step(self, seqs: list[int], q_lens: list[int]) -> None:
        tables, seq_lens, qs, ks, vs = [], [], [], [], []
        for s, n in zip(seqs, q_lens):
            old = len(self.hist_k.get(s, []))
            table = self.tables.setdefault(s, [])
            while len(table) < blocks_for(old + n, self.bs):
                table.append(self.free.pop())
            tables.append(list(table))
            seq_lens.append(old + n)
            q, k, v = self._rand(n, self.H, self.d), self._rand(n, self.KV, self.d), self._rand(n, self.KV, self.d)
            qs.append(q), ks.append(k), vs.append(v)
            self.hist_k[s] = torch.cat([self.hist_k[s], k]) if s in self.hist_k else k
            self.hist_v[s] = torch.cat([self.hist_v[s], v]) if s in self.hist_v else v
        meta = build_attention_metadata(q_lens, seq_lens, tables, self.bs, self.window)
        out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), self.k_cache, self.v_cache, meta, self.scale)
        assert out.shape == (sum(q_lens), self.H * self.d)
        assert torch.isfinite(out).all()
        start = 0
        for s, n, q in zip(seqs, q_lens, qs):
            want = _naive(q, self.hist_k[s], self.hist_v[s], self.scale, self.window)
            torch.testing.assert_close(out[start:start + n], want, atol=1e-10, rtol=1e-10,
                                       msg=lambda m, s=s: f"sequence {s} (q_lens {q_lens}, seq_lens {seq_lens}): {m}")
            start += n
        for s, table in zip(seqs, tables):  # the cache holds every key at its slot
            flat = self.k_cache.view(-1, self.KV, self.d)
            slots = [table[p // self.bs] * self.bs + p % self.bs for p in range(len(self.hist_k[s]))]
            assert torch.equal(flat[slots], self.hist_k[s])


@pytest.mark.parametrize("H,KV", [(4, 4), (4, 2), (8, 1)])
def test_paged_attention_matches_naive(H, KV):
    run = _PagedRun(H, KV, d=8)
    run.step([0, 1, 2], [5, 3, 5])  # prefill, fresh, uniform-ish lengths mixed
    run.step([0, 1, 2], [1, 1, 1])  # decode with cache
    run.step([0, 1, 2], [1, 1, 1])
    run.step([0, 2], [1, 1])  # a sequence dropped out
    run.step([1, 3], [4, 7])  # chunked prefill next to a fresh prompt: mixed cached/fresh
    run.step([3, 0, 1], [1, 1, 1])


def test_paged_attention_uniform_fresh_prefill():
    run = _PagedRun(4, 2, d=8)
    run.step([0, 1], [6, 6])  # the mask-free is_causal path
    run.step([0, 1], [1, 1])


@pytest.mark.parametrize("window", [1, 3, 5])
def test_paged_attention_sliding_window(window):
    run = _PagedRun(4, 2, d=8, window=window)
    run.step([0, 1], [7, 7])
    run.step([0, 1], [1, 1])
    run.step([0, 1], [3, 1])
    run.step([2, 0], [2, 1])


# --- sampling ------------------------------------------------------------------------------------

def test_filter_logits_top_k():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, -1.0, 2.0, 1.0, 3.0]])
    out = filter_logits(logits, 2, 1.0)
    assert torch.isinf(out).sum(-1).tolist() == [3, 3]
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]]) and torch.equal(out[1, [2, 4]], logits[1, [2, 4]])
    assert torch.equal(filter_logits(logits, 0, 1.0), logits)
    assert torch.equal(filter_logits(logits, 5, 1.0), logits)
    assert torch.equal(filter_logits(logits, 99, 1.0), logits)


def test_filter_logits_top_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05 (not in index order)
    logits = probs.log()[None]

    def kept(top_p, top_k=0):
        return sorted(torch.nonzero(torch.isfinite(filter_logits(logits, top_k, top_p)[0])).flatten().tolist())

    assert kept(0.4) == [1]  # the top token alone already covers 0.4
    assert kept(0.7) == [1, 3]  # 0.5 < 0.7 <= 0.8
    assert kept(0.9) == [1, 2, 3]  # 0.8 < 0.9 <= 0.95
    assert kept(0.99) == [0, 1, 2, 3]
    assert kept(1e-6) == [1], "the most likely token is always kept"
    assert kept(0.9, top_k=2) == [1, 3], "top-k first, then top-p over what is left"
    # filtered logits keep their values
    out = filter_logits(logits, 0, 0.7)[0]
    assert torch.equal(out[[1, 3]], logits[0, [1, 3]])
    assert not torch.equal(filter_logits(logits, 0, 0.7), logits), "the input is not modified in place"
    assert torch.isfinite(logits).all()


def test_sample_greedy_and_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen)
    out = sample_rows(logits, [RowSampling() for _ in range(3)])
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(out.logprobs.float(), torch.log_softmax(logits, -1).gather(-1, out.tokens[:, None])[:, 0])


def test_sample_seeded_is_deterministic_and_per_sequence():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 200, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)

    def draw(rows, seed=7, steps=6):
        """Tokens 0..steps-1 of each row's request (the row index is its own seed offset)."""
        return [[int(sample_rows(logits[[b]], [RowSampling.of(params, seed + b, i)]).tokens[0]) for i in range(steps)]
                for b in rows]

    full = draw([0, 1, 2, 3])
    assert full == draw([0, 1, 2, 3]), "same seed, same tokens"
    assert [full[1], full[3]] == draw([1, 3]), "a sequence's draws do not depend on the rest of the batch"
    assert full != draw([0, 1, 2, 3], seed=8), "another seed, other tokens"
    batched = [sample_rows(logits, [RowSampling.of(params, 7 + b, i) for b in range(4)]).tokens.tolist()
               for i in range(6)]
    assert [list(col) for col in zip(*batched)] == full, "the same draws in one batched call"
    allowed = torch.isfinite(filter_logits(logits / 0.8, 20, 0.9))
    for b, row in enumerate(full):
        assert all(allowed[b, t] for t in row), "samples only from the filtered set"
    one = SamplingParams(temperature=1.0, top_k=1, seed=3)
    tokens = sample_rows(logits, [RowSampling.of(one, 3, 0) for _ in range(4)]).tokens
    assert tokens.tolist() == logits.argmax(-1).tolist(), "top_k=1 is greedy"


@pytest.mark.parametrize("kwargs,field", [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
                                          ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# --- paged KV cache ------------------------------------------------------------------------------

def test_paged_kv_cache_block_accounting():
    cache = PagedKVCache(num_layers=2, num_blocks=6, block_size=4, kv_heads=2, head_dim=8)
    assert len(cache.layers) == 2 and cache.layers[0][0].shape == (6, 4, 2, 8)
    assert cache.bytes == 2 * 2 * 6 * 4 * 2 * 8 * 4
    a = cache.reserve(0, 5)
    assert len(a) == 2 and cache.allocator.num_free == 4
    cache.advance(0, 5)
    assert cache.reserve(0, 3) == a, "8 tokens still fit in 2 blocks"
    cache.advance(0, 3)
    assert len(cache.reserve(0, 1)) == 3
    cache.advance(0, 1)
    b = cache.reserve(1, 12)
    assert len(b) == 3 and cache.allocator.num_free == 0
    assert not set(a) & set(b), "sequences never share a block"
    assert cache.lengths == {0: 9, 1: 0}
    with pytest.raises(CacheFullError, match="6 blocks"):
        cache.reserve(2, 1)
    cache.free(0)
    assert cache.allocator.num_free == 3 and 0 not in cache.tables and 0 not in cache.lengths
    cache.free(1)
    cache.free(2)  # a sequence that got nothing (its reserve failed): freeing is harmless
    assert cache.allocator.num_free == 6
    assert sorted(cache.allocator._free) == list(range(6)), "every block came back exactly once"
    cache.free(7)  # unknown sequence: no-op
    assert cache.allocator.num_free == 6


def test_block_allocator_and_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    alloc = BlockAllocator(3)
    got = [alloc.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    with pytest.raises(CacheFullError):
        alloc.allocate()
    alloc.free(got)
    assert alloc.num_free == 3


# --- RoPE ----------------------------------------------------------------------------------------

LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def _hf_llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


@pytest.mark.parametrize("hidden,heads,theta,scaling", [
    (4096, 32, 500000.0, LLAMA31_SCALING),  # Llama 3.1 8B
    (64, 4, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}),  # the test checkpoint's
    (256, 2, 10000.0, {"rope_type": "linear", "factor": 4.0}),
])
def test_inverse_frequencies_match_transformers(hidden, heads, theta, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = _hf_llama_config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                              max_position_embeddings=131072, rope_theta=theta, rope_scaling=dict(scaling))
    want, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    assert attention_factor == 1.0
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    assert cfg.rope_theta == theta and cfg.rope_scaling["rope_type"] == scaling["rope_type"]
    got = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=0, rtol=1e-7)
    if scaling["rope_type"] == "llama3":
        plain = inverse_frequencies(cfg.head_dim, cfg.rope_theta)
        assert not torch.equal(got, plain), "the scaling changes something"
        wavelen = 2 * math.pi / plain
        short = wavelen < scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
        assert torch.equal(got[short], plain[short]), "short wavelengths are untouched"


def test_rotary_cos_sin_match_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    hf_cfg = _hf_llama_config(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                              rope_scaling=scaling)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    ours = Rotary(cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling)
    positions = torch.tensor([0, 1, 5, 31, 32, 33, 100, 255])
    cos_hf, sin_hf = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, 1, dtype=torch.float32), positions[None])
    cos, sin = ours.cos_sin(positions)
    torch.testing.assert_close(cos, cos_hf[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, sin_hf[0], atol=1e-6, rtol=1e-6)


def test_apply_rotary_is_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen)
    rot = Rotary(16, 64, 10000.0)
    cos, sin = rot.cos_sin(torch.arange(5) + 7)
    q_hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(apply_rotary(x, cos, sin), q_hf[0].transpose(0, 1))


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(ModelConfigError, match="yarn"):
        inverse_frequencies(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})


# --- ModelConfig.from_hf -------------------------------------------------------------------------

DENSE_ARCHS = ("llama-gqa", "llama-mqa", "mistral", "qwen2", "llama-tied", "llama31-rope")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("units")
    return {arch: write_hf_checkpoint(root, arch) for arch in DENSE_ARCHS}


def test_model_config_from_each_arch(checkpoints):
    cfgs = {arch: ModelConfig.from_hf(json.loads((path / "config.json").read_text())) for arch, path in checkpoints.items()}
    for arch, cfg in cfgs.items():
        assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size) == (64, 2, 4, 16, 128), arch
        assert cfg.intermediate_size == 128 and cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 10000.0, arch
        assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1, arch
        assert not cfg.mlp_bias and not cfg.o_bias, arch
    assert cfgs["llama-gqa"].model_type == "llama" and cfgs["llama-gqa"].num_kv_heads == 2
    assert cfgs["llama-gqa"].rope_scaling is None and cfgs["llama-gqa"].sliding_window is None
    assert not cfgs["llama-gqa"].qkv_bias and not cfgs["llama-gqa"].tie_word_embeddings
    assert cfgs["llama-gqa"].max_positions == 128
    assert cfgs["llama-mqa"].num_kv_heads == 1
    assert cfgs["mistral"].model_type == "mistral" and cfgs["mistral"].sliding_window == 4096
    assert cfgs["qwen2"].model_type == "qwen2" and cfgs["qwen2"].qkv_bias and cfgs["qwen2"].sliding_window is None
    assert cfgs["llama-tied"].tie_word_embeddings
    rope = cfgs["llama31-rope"]
    assert rope.max_positions == 256
    assert rope.rope_scaling["rope_type"] == "llama3" and rope.rope_scaling["factor"] == 8.0
    assert rope.rope_scaling["original_max_position_embeddings"] == 32
    assert rope.rope_scaling["low_freq_factor"] == 1.0 and rope.rope_scaling["high_freq_factor"] == 4.0


def test_model_config_errors_name_the_field(checkpoints):
    base = json.loads((checkpoints["llama-gqa"] / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    broken = dict(base)
    del broken["vocab_size"]
    with pytest.raises(ModelConfigError, match="vocab_size"):
        ModelConfig.from_hf(broken, "x/config.json")


def test_qwen2_sliding_window_follows_max_window_layers(checkpoints):
    """HF Qwen2 windows only layers >= max_window_layers: all of them, none of them, or (unsupported) some."""
    base = json.loads((checkpoints["qwen2"] / "config.json").read_text())
    base.pop("layer_types", None)
    on = {**base, "use_sliding_window": True, "sliding_window": 8}
    assert ModelConfig.from_hf({**on, "max_window_layers": 0}).sliding_window == 8
    assert ModelConfig.from_hf({**on, "max_window_layers": 2}).sliding_window is None
    assert ModelConfig.from_hf({**on, "max_window_layers": 28}).sliding_window is None  # HF's default: no layer
    assert ModelConfig.from_hf({**on, "layer_types": ["sliding_attention"] * 2}).sliding_window == 8
    with pytest.raises(ModelConfigError, match="max_window_layers 1 of 2"):
        ModelConfig.from_hf({**on, "max_window_layers": 1})
    assert ModelConfig.from_hf({**base, "use_sliding_window": False, "sliding_window": 8}).sliding_window is None


# --- the single-process library path -------------------------------------------------------------

@pytest.fixture(scope="module")
def world_groups():
    """A gloo world of one rank for this module (torch.distributed initialises once per process)."""
    import torch.distributed as dist

    from dist_infer.comm import build_groups, init_world
    from dist_infer.topology import Layout, Mesh

    if dist.is_initialized():
        pytest.skip("torch.distributed already initialised in this process by another test module")
    world = init_world("gloo")
    groups = build_groups(world, Mesh.build(Layout(), world.size))
    assert world.size == 1 and groups.tp.size == 1 and groups.pp.size == 1
    yield groups
    groups.destroy()
    world.destroy()


def _lib_prompts(lengths=(5, 17, 40)):
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]


def _assert_like_hf(outputs, prompts, ids, logits, what, eos=2):
    """The library generates with EOS stop on: a sequence may end early, at HF's EOS token."""
    for b, (o, want_ids, want) in enumerate(zip(outputs, ids, logits)):
        assert o.prompt_token_ids == prompts[b]
        n = len(o.token_ids)
        if o.finish_reason == "stop":  # OpenAI's name for an EOS stop
            assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
        else:
            assert o.finish_reason == "length" and n == len(want_ids)
        assert o.token_ids == want_ids[:n], f"{what} prompt {b}: {o.token_ids} vs HF {want_ids}"
        assert eos not in want_ids[:n - 1], f"{what} prompt {b}: HF produced EOS earlier"
        torch.testing.assert_close(torch.stack(o.logits), want[:n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,overrides", [
    ("llama-gqa", {}),
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),  # every layer windowed
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),  # no layer windowed
])
def test_api_shard_in_memory_model_matches_hf(world_groups, tmp_path, arch, overrides):
    from dist_infer.engine.api import ShardedModel, shard
    from dist_infer.topology import Layout

    path = write_hf_checkpoint(tmp_path, arch, **overrides)
    hf_model = load_hf_model(path)
    prompts = _lib_prompts()
    ids, logits = hf_reference(path, prompts, 6, model=hf_model)
    model = shard(hf_model, Layout(), groups=world_groups)
    want_window = {"llama-gqa": None, "mistral": 8, "qwen2": 8 if overrides.get("max_window_layers") == 0 else None}[arch]
    assert isinstance(model, ShardedModel) and model.config.sliding_window == want_window
    outputs = model.generate(prompts, max_new_tokens=6, return_logits=True)
    _assert_like_hf(outputs, prompts, ids, logits, f"api.shard {arch} {overrides}")


def test_api_load_matches_shard(world_groups, tmp_path):
    from dist_infer.engine.api import load

    path = write_hf_checkpoint(tmp_path, "qwen2")
    prompts = _lib_prompts((9, 3))
    ids, logits = hf_reference(path, prompts, 4)
    model = load(path, groups=world_groups, block_size=4)
    outputs = model.generate(prompts, max_new_tokens=4, return_logits=True)
    _assert_like_hf(outputs, prompts, ids, logits, "api.load qwen2")


def test_mlp_in_row_slices_matches_hf(world_groups, tmp_path, monkeypatch):
    """A prefill longer than LlamaMLP.ROW_CHUNK runs the MLP slice by slice (its temporaries are a long
    prefill's memory peak); with slices of 4 rows every prompt here is sliced, and the result is HF's."""
    from dist_infer.engine.api import load
    from dist_infer.models.llama import LlamaMLP

    monkeypatch.setattr(LlamaMLP, "ROW_CHUNK", 4)
    path = write_hf_checkpoint(tmp_path, "llama-gqa")
    prompts = _lib_prompts((5, 17, 40))
    ids, logits = hf_reference(path, prompts, 4)
    outputs = load(path, groups=world_groups).generate(prompts, max_new_tokens=4, return_logits=True)
    _assert_like_hf(outputs, prompts, ids, logits, "MLP in 4-row slices")


def test_native_kernels_switch_in_process(world_groups, tmp_path):
    """The kernels are handed to the layers (`use_native_kernels`), so the same loaded model runs
    with them (the profiler names each call) and, switched off in the same process, without them
    (torch's ops only); both give HF's tokens and logits."""
    from torch.profiler import ProfilerActivity, profile

    from dist_infer.engine.api import load
    from dist_infer.kernels import load_cpu_kernels, use_native_kernels

    if load_cpu_kernels() is None:
        pytest.skip("no C compiler: the native kernels are not built")
    path = write_hf_checkpoint(tmp_path, "llama-gqa")
    prompts = _lib_prompts((5, 17))
    ids, logits = hf_reference(path, prompts, 4)
    model = load(path, groups=world_groups)

    def run_profiled():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = model.generate(prompts, max_new_tokens=4, return_logits=True)
        return out, {e.key for e in prof.key_averages()}

    on, names_on = run_profiled()
    use_native_kernels(model.engine.stage, None)
    off, names_off = run_profiled()
    assert "dist_infer::decode_stack" in names_on  # every step's layers in one native call (fused_decode.py)
    assert not any(n.startswith("dist_infer::") and "linear" in n for n in names_off), sorted(names_off)[:20]
    _assert_like_hf(on, prompts, ids, logits, "kernels on")
    _assert_like_hf(off, prompts, ids, logits, "kernels off")

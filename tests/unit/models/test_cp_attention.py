"""Context parallelism's bookkeeping in this process (models/cp_attention.py): which rank holds
which positions of a prompt, the ring variant chosen, who stores a decode token, and the merge of
the shards' partials into attention over the whole cache. (The full model with cp through the
real CLI, against HF transformers: tests/integration/test_cp_model.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dist_infer.kernels import load_cpu_kernels
from dist_infer.models.cp_attention import (
    ContextParallelError,
    cp_decode_metadata,
    cp_decode_owner,
    cp_prefill_metadata,
    shard_decode_attention,
)
from dist_infer.parallel.ring.lse import merge_many


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_prefill_metadata_splits_every_prompt_exactly_once(cp):
    lens = [3, 45, 150]
    held = {b: [] for b in range(len(lens))}
    last_owners = {b: [] for b in range(len(lens))}
    for r in range(cp):
        tables = [list(range(100 * b, 100 * b + 20)) for b in range(len(lens))]
        meta, mine = cp_prefill_metadata(lens, cp, r, tables, 16, q_heads=4, kv_heads=2)
        assert meta.cp.variant == "pass-kv", "a fresh prefill of a GQA model moves the KV"
        flat = [p for pos in mine for p in pos]
        assert meta.positions.tolist() == flat
        assert len(set(meta.slot_mapping.tolist())) == len(flat), "each local token gets its own cache slot"
        row = 0
        for b, pos in enumerate(mine):
            held[b] += pos
            assert max(pos, default=-1) <= lens[b] - 1 and len(pos) <= -(-lens[b] // (2 * cp)) * 2
            last = int(meta.cp.last_rows[b])
            if last >= 0:
                last_owners[b].append(r)
                assert flat[last] == lens[b] - 1 and row <= last < row + len(pos)
            row += len(pos)
    for b, n in enumerate(lens):
        assert sorted(held[b]) == list(range(n)), f"prompt {b}"
        assert len(last_owners[b]) == 1, f"prompt {b}: last token on ranks {last_owners[b]}"


def test_auto_variant_for_a_fresh_prefill():
    table = [list(range(100))]
    for heads, kv_heads, prompt, want in (
        (4, 2, 40, "pass-kv"),  # GQA: Q is as large as K+V
        (4, 4, 40, "pass-q"),  # MHA, 20 tokens per rank: K+V too big to hide
        (4, 4, 1000, "pass-kv"),
    ):  # MHA, 500 per rank: its transfer hides
        meta, _ = cp_prefill_metadata([prompt], 2, 0, table, 16, q_heads=heads, kv_heads=kv_heads)
        assert meta.cp.variant == want, (heads, kv_heads, prompt)
    assert cp_prefill_metadata([40], 2, 0, table, 16, "pass-q", 4, 2)[0].cp.variant == "pass-q", "forced"


def test_decode_tokens_go_round_robin_and_shards_stay_even():
    cp, prompt = 4, 150
    counts = [len(cp_prefill_metadata([prompt], cp, r, [list(range(20))], 16)[1][0]) for r in range(cp)]
    spread = max(counts) - min(counts)
    for t in range(40):
        owner = cp_decode_owner(prompt + t, prompt, cp)
        assert owner == t % cp
        counts[owner] += 1
        assert max(counts) - min(counts) <= spread + 1, counts
    assert sum(counts) == prompt + 40


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native-kernel"])
def test_sharded_decode_merges_to_attention_over_the_whole_cache(native):
    """Each rank's partial (output, LSE) over its shard, merged, is attention over every key; the
    native kernel's partials (one call through the block table) as well as torch's."""
    kernels = load_cpu_kernels() if native else None
    if native and kernels is None:
        pytest.skip("no C compiler: the native kernels do not build here")
    gen = torch.Generator().manual_seed(0)
    cp, heads, kv_heads, d, bs = 3, 4, 2, 8, 4
    lens = [[5, 0, 9], [1, 2, 3]]  # keys of each sequence on each rank; sequence 0 has none on rank 1
    q = torch.randn(2, heads, d, generator=gen)
    keys = [[torch.randn(n, kv_heads, d, generator=gen) for n in per] for per in lens]
    vals = [[torch.randn(n, kv_heads, d, generator=gen) for n in per] for per in lens]
    parts_o, parts_l = [], []
    for r in range(cp):
        k_cache, v_cache = torch.zeros(8, bs, kv_heads, d), torch.zeros(8, bs, kv_heads, d)
        tables = [[2 * b, 2 * b + 1, 7 - b] for b in range(2)]
        for b in range(2):
            for i in range(lens[b][r]):
                slot = tables[b][i // bs] * bs + i % bs
                k_cache.view(-1, kv_heads, d)[slot] = keys[b][r][i]
                v_cache.view(-1, kv_heads, d)[slot] = vals[b][r][i]
        meta = cp_decode_metadata([40, 41], [False, False], [lens[0][r], lens[1][r]], tables, bs)
        o, lse = shard_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, d**-0.5, kernels)
        if lens[0][r] == 0:
            assert torch.isneginf(lse[0]).all() and (o[0] == 0).all()
        parts_o.append(o), parts_l.append(lse)
    got, _ = merge_many(torch.stack(parts_o), torch.stack(parts_l))
    for b in range(2):
        k_all = torch.cat(keys[b]).repeat_interleave(heads // kv_heads, 1)
        v_all = torch.cat(vals[b]).repeat_interleave(heads // kv_heads, 1)
        probs = torch.softmax(torch.einsum("hd,khd->hk", q[b], k_all) * d**-0.5, -1)
        torch.testing.assert_close(got[b], torch.einsum("hk,khd->hd", probs, v_all), atol=1e-6, rtol=1e-6)


def test_decode_metadata_stores_only_this_ranks_tokens():
    meta = cp_decode_metadata([10, 20], [True, False], [3, 7], [[5], [6]], 16)
    assert meta.cp.store_rows.tolist() == [0]
    assert meta.slot_mapping.tolist() == [5 * 16 + 2], "stored as the last row of the shard"


def test_unsupported_cp_setups_are_refused_with_the_numbers():
    from dist_infer.engine.engine_core import Engine, EngineConfig, WorkerOptions

    groups = SimpleNamespace(cp=SimpleNamespace(size=2, rank=0), pp=SimpleNamespace(size=2), tp=SimpleNamespace(size=1))
    with pytest.raises(ContextParallelError, match=r"cp with pp is not supported yet \(cp=2, pp=2\)"):
        Engine(SimpleNamespace(cfg=None, cp=object()), groups)
    with pytest.raises(ContextParallelError, match="cp variant 'ring' is not one of"):
        Engine(SimpleNamespace(cfg=None, cp=object()), groups, EngineConfig(worker=WorkerOptions(cp_variant="ring")))
    with pytest.raises(ContextParallelError, match="prompt of 300 tokens exceeds the model's window of 256"):
        cp_prefill_metadata([300], 2, 0, [list(range(20))], 16, sliding_window=256)

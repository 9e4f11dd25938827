"""Automatic prefix caching: the block hashes, the block pool (reference counts, LRU eviction,
free + used + cached-evictable == total), the scheduler's use of it under random add / step /
finish / abort / preemption sequences (no request ever writes into a block another holds, and
every block a request reads holds what its tokens would have put there), and the engine on a
real small model with caching on and off: HF's greedy tokens, the same logits, the same seeded
samples, with and without preemption, one rank and tp=2 on threads."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dist_infer.engine.block_pool import BlockPool, CacheFullError
from dist_infer.engine.prefix_cache import ROOT_HASH, extend_hashes, hash_block
from dist_infer.engine.request import Request, RequestStatus
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.scheduler_config import SchedulerConfig
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.engine_streams import serve_stream
from tests.support.hf_compare import ATOL, RTOL, prompts_for, steps_agreeing_with_hf
from tests.support.threads import run_ranks, thread_groups

BS = 4


# -- hashes ------------------------------------------------------------------------------------------


def test_block_hashes_chain_over_the_prefix():
    a = list(range(3, 3 + 4 * BS))
    b = a[:]
    b[BS + 2] = 99  # differs in block 1
    ha, hb = extend_hashes([], a, BS, 4), extend_hashes([], b, BS, 4)
    assert ha[0] == hb[0], "same first block, same hash"
    assert all(x != y for x, y in zip(ha[1:], hb[1:])), "one token different: every hash from its block on differs"
    assert ha[2] != hash_block(ROOT_HASH, a[2 * BS : 3 * BS]), "a block's hash covers its parents, not only its tokens"
    assert extend_hashes(ha[:2], a, BS, 4) == ha, "extending goes on from the hashes there are"
    with pytest.raises(ValueError, match="not full"):
        extend_hashes([], a[: BS + 1], BS, 2)


def test_block_hashes_are_stable_across_processes():
    """Not Python's salted hash(): another process with another hash seed names the block alike."""
    code = (
        "from dist_infer.engine.prefix_cache import ROOT_HASH, hash_block; print(hash_block(ROOT_HASH, [5, 6, 7, 8]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert int(out.stdout) == hash_block(ROOT_HASH, [5, 6, 7, 8])


# -- the block pool ----------------------------------------------------------------------------------


def test_pool_matches_the_longest_cached_run_and_counts_references():
    pool = BlockPool(8)
    blocks = [pool.allocate() for _ in range(3)]
    hashes = [11, 22, 33]
    for b, h in zip(blocks, hashes):
        assert pool.register(b, h)
    assert not pool.register(pool.allocate(), 22), "another block already has that hash: this one stays private"
    assert pool.match([11, 22, 33, 44]) == blocks
    assert pool.match([11, 99, 33]) == blocks[:1], "the run stops at the first miss"
    assert pool.match([99, 22]) == []
    pool.take(blocks[:2])
    assert [pool.refcount(b) for b in blocks] == [2, 2, 1]
    pool.free(blocks)
    assert [pool.refcount(b) for b in blocks] == [1, 1, 0] and pool.num_evictable == 1
    assert pool.reclaimed_by(blocks) == 1, "taking the match uses up one allocatable block"
    pool.free(blocks[:2])
    assert pool.num_evictable == 3 and pool.num_free == 7 and pool.check() is None
    assert pool.match(hashes) == blocks, "freed blocks stay cached"
    with pytest.raises(ValueError, match="not held"):
        pool.free(blocks[:1])


def test_pool_evicts_the_least_recently_freed_and_only_when_needed():
    pool = BlockPool(4)
    a, b, c, d = (pool.allocate() for _ in range(4))
    for block, h in ((a, 1), (b, 2), (c, 3)):
        pool.register(block, h)
    pool.free([a, b])  # a sequence's blocks: the tail (b) is freed first, so it goes first
    pool.free([c])
    with pytest.raises(CacheFullError):
        BlockPool(0).allocate()
    assert pool.allocate() == b and pool.match([1, 2]) == [a], "b evicted first, and forgotten"
    pool.take([a])  # a hit: no longer evictable
    assert pool.allocate() == c, "c is now the least recently freed"
    with pytest.raises(CacheFullError):
        pool.allocate()
    pool.free([d])  # never cached: straight to the free list, taken before any cached block
    pool.free([a])
    assert pool.allocate() == d and pool.match([1]) == [a]
    assert pool.check() is None


# -- the scheduler -------------------------------------------------------------------------------


def _req(name: str, tokens: list[int], max_new: int = 3) -> Request:
    return Request(name, list(tokens), SamplingParams(max_new_tokens=max_new), seed=0)


def _run(s: Scheduler, out, token: int = 7) -> None:
    for c in out.chunks:
        if c.sample:
            c.request.output_token_ids.append(token)
            s.on_sampled(c.request)


def _cached_scheduler(blocks: int = 32, budget=None, **kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=blocks, block_size=BS, max_batched_tokens=budget, prefix_caching=True, watermark=0.0, **kw
        )
    )


def test_a_request_starts_after_its_cached_prefix():
    s = _cached_scheduler()
    prefix = list(range(10, 10 + 3 * BS))
    a = _req("a", prefix + [1, 2])
    s.add(a)
    _run(s, s.schedule())
    b = _req("b", prefix + [5])
    s.add(b)
    out = s.schedule()  # a's prompt blocks are registered now: its step has left
    chunk = next(c for c in out.chunks if c.request is b)
    assert (chunk.start, chunk.num_tokens) == (3 * BS, 1), "only the part after the cached blocks is computed"
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] not in a.block_table
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (len(a.prompt_token_ids) + 13, 3 * BS)


@pytest.mark.parametrize("length", [3 * BS, 3 * BS + 2])
def test_a_wholly_cached_prompt_still_computes_its_last_token_in_a_block_of_its_own(length):
    s = _cached_scheduler()
    prompt = list(range(20, 20 + length))
    a = _req("a", prompt)
    s.add(a)
    _run(s, s.schedule())
    s.finish(a, "stop")
    b = _req("b", prompt)
    s.add(b)
    (chunk,) = s.schedule().chunks
    cached = (length - 1) // BS * BS
    assert chunk.start == cached and chunk.start + chunk.num_tokens == length and chunk.sample
    last = b.block_table[(length - 1) // BS]
    assert s.allocator.refcount(last) == 1 and not s.allocator.is_cached(last), "the written block is private"


def test_a_finish_keeps_blocks_cached_an_abort_registers_none():
    s = _cached_scheduler(blocks=8)
    a = _req("a", list(range(30, 30 + 2 * BS + 1)))
    s.add(a)
    _run(s, s.schedule())  # 9 tokens computed, 2 full blocks: registered at the next schedule or finish
    s.finish(a, "abort")
    assert s.allocator.num_cached == 0, "an abort may be a step that never ran: nothing new is registered"
    b = _req("b", list(range(30, 30 + 2 * BS + 1)))
    s.add(b)
    _run(s, s.schedule())
    s.finish(b, "length")
    assert s.allocator.num_cached == 2 and s.num_cached_blocks == 2 and s.num_free_blocks == 8


def test_migrated_in_blocks_are_never_registered():
    s = _cached_scheduler()
    r = _req("m", list(range(40, 40 + 2 * BS + 1)))
    r.num_computed = 2 * BS  # its last token is still to compute
    s.install(r, [s.allocator.allocate() for _ in range(3)])
    _run(s, s.schedule())
    s.schedule()
    assert s.allocator.num_cached == 0
    s.finish(r, "length")
    assert s.allocator.num_cached == 0 and s.num_free_blocks == 32


def test_context_parallel_refuses_prefix_caching():
    with pytest.raises(ValueError, match="context parallel"):
        Scheduler(SchedulerConfig(num_blocks=8, prefix_caching=True), cp=2)
    with pytest.raises(ValueError, match="context parallel"):
        SchedulerConfig(num_blocks=8, prefix_caching=True, whole_prompt_steps=True)


def _kv(tokens: list[int], pos: int) -> int:
    """What a token's keys and values are a function of: its position and every token up to it."""
    return hash(tuple(tokens[: pos + 1]))


def _check_step(s: Scheduler, out, kv: dict) -> None:
    """Every chunk writes only blocks it alone holds and that are not cached; what it reads holds
    what its own tokens would have put there. `kv`: (block, offset) -> what was written."""
    for c in out.chunks:
        r, toks = c.request, c.request.all_token_ids
        for pos in range(c.start, c.start + c.num_tokens):
            block = r.block_table[pos // BS]
            assert s.allocator.refcount(block) == 1, f"{r.request_id} writes block {block} someone else holds"
            assert not s.allocator.is_cached(block), f"{r.request_id} writes cached block {block}"
        for pos in range(c.start):
            assert kv.get((r.block_table[pos // BS], pos % BS)) == _kv(toks, pos), (
                f"{r.request_id} reads stale KV at {pos}"
            )
    for c in out.chunks:
        toks = c.request.all_token_ids
        for pos in range(c.start, c.start + c.num_tokens):
            kv[(c.request.block_table[pos // BS], pos % BS)] = _kv(toks, pos)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "step", "abort", "finish"]), st.integers(0, 10**6)
    ),
    min_size=5,
    max_size=80,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, blocks=st.integers(5, 16), budget=st.sampled_from([None, 3, 7]))
def test_random_sequences_conserve_blocks_and_never_share_a_written_block(ops, blocks, budget):
    s = _cached_scheduler(blocks=blocks, budget=budget, max_num_seqs=4)
    prefixes = [[5] * 6, [5] * 5 + [6] + [7] * 4, [9, 8, 7, 6, 5, 4, 3, 2]]
    kv: dict = {}
    live: list[Request] = []
    n = 0
    for op, x in ops:
        rng = random.Random(x)
        if op == "add":
            prompt = rng.choice(prefixes)[: rng.randint(1, 8)] + [rng.randint(3, 6) for _ in range(rng.randint(0, 5))]
            if s.check_fits(len(prompt), 10) is None:
                r = _req(f"r{n}", prompt, max_new=10)
                n += 1
                s.add(r)
                live.append(r)
        elif op == "step":
            out = s.schedule()
            _check_step(s, out, kv)
            _run(s, out, token=3 + x % 4)
            for r in [r for r in s.running if len(r.output_token_ids) >= r.params.max_new_tokens]:
                s.finish(r, "length")
        elif live:
            r = live[x % len(live)]
            s.finish(r, "abort" if op == "abort" else "stop")
        live = [r for r in live if r.status is not RequestStatus.FINISHED]
        assert s.allocator.check() is None
        held = Counter(b for r in s.running for b in r.block_table)
        assert held == {b: s.allocator.refcount(b) for b in range(blocks) if s.allocator.refcount(b)}, (
            "a block's reference count is the number of running requests holding it"
        )
    for r in list(live):
        s.finish(r, "abort")
    assert s.allocator.check() is None and s.num_free_blocks == blocks, "idle: free + cached-evictable == total"


# -- the engine on a real model -------------------------------------------------------------------

NEW = 5


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("prefix"), "llama-gqa")
    return path, load_hf_model(path)


def _engine(model, groups, **kw):
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    return Engine(stage_from_hf_model(model, groups), groups, EngineConfig(block_size=BS, **kw))


def _shared_prompts() -> list[list[int]]:
    """Prompts sharing an 11-token prefix: one of 12 tokens (a multiple of the block size), one
    asked twice (the second wholly cached), one the bare prefix, and one that shares nothing."""
    prefix, tails = prompts_for([11], seed=7)[0], prompts_for([1, 5, 3, 9], seed=8)
    return [prefix + tails[1], prefix + tails[0], prefix + tails[2], prefix + tails[1], prefix, tails[3]]


ARRIVALS = [0, 0, 3, 6, 9, 10]


def _serve(engine, prompts, params, arrivals=ARRIVALS):
    """serve_stream with the logits returned."""
    engine.return_logits = True
    return serve_stream(engine, prompts, params, arrivals, max_steps=2000)


def _assert_hf(r, ref, what: str) -> None:
    (want,), (want_logits,) = ref
    steps = steps_agreeing_with_hf(r.output_token_ids, want, want_logits, what)
    torch.testing.assert_close(torch.stack(r.logits)[:steps], want_logits[:steps], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("blocks", [64, 7], ids=["roomy", "preempting"])
def test_caching_on_and_off_give_hfs_tokens_and_the_same_logits(llama, blocks):
    _, model = llama
    prompts = _shared_prompts()
    refs = [hf_reference(None, [p], NEW, model=model) for p in prompts]
    params = SamplingParams(max_new_tokens=NEW, stop_at_eos=False)
    (groups,) = thread_groups(1, 1)
    runs = {}
    for caching in (True, False):
        engine = _engine(model, groups, num_blocks=blocks, max_batched_tokens=6, max_num_seqs=3, prefix_caching=caching)
        reqs = _serve(engine, prompts, params)
        stats = engine.stats()
        engine.stop_followers()
        for i, r in enumerate(reqs):
            _assert_hf(r, refs[i], f"caching {caching}, {blocks} blocks, prompt {i}")
        assert stats["free_blocks"] == blocks, "idle: every block allocatable (free or cached)"
        if blocks < 20:
            assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for everyone"
        runs[caching] = reqs, stats
    (on, on_stats), (off, off_stats) = runs[True], runs[False]
    assert off_stats["prefix_cache_hits"] == off_stats["prefix_cache_queries"] == off_stats["cached_blocks"] == 0
    assert on_stats["prefix_cache_hits"] >= 2 * 8, "the later prompts start from the cached prefix"
    assert on_stats["prefix_cache_queries"] >= sum(len(p) for p in prompts)
    assert on_stats["cached_blocks"] > 0
    for i, (a, b) in enumerate(zip(on, off)):
        assert a.output_token_ids == b.output_token_ids, f"prompt {i}: caching changed the tokens"
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=ATOL, rtol=RTOL)


def test_a_wholly_cached_prompt_samples_its_first_token_from_the_last_one(llama):
    _, model = llama
    prompt = prompts_for([3 * BS], seed=9)[0]
    ref = hf_reference(None, [prompt], NEW, model=model)
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups, num_blocks=32, prefix_caching=True)
    params = SamplingParams(max_new_tokens=NEW, stop_at_eos=False)
    first, second = _serve(engine, [prompt, prompt], params, arrivals=[0, 8])
    assert engine.stats()["prefix_cache_hits"] == 2 * BS, "all but the last block: its last token is computed"
    engine.stop_followers()
    for r in (first, second):
        _assert_hf(r, ref, "whole prompt cached")
    assert first.output_token_ids == second.output_token_ids


def test_seeded_sampling_is_the_same_with_caching_on_and_off(llama):
    _, model = llama
    prompts = _shared_prompts()
    params = [
        SamplingParams(max_new_tokens=NEW, temperature=0.9, top_k=30, top_p=0.95, seed=50 + i, stop_at_eos=False)
        for i in range(len(prompts))
    ]
    (groups,) = thread_groups(1, 1)
    got = {}
    for caching, blocks in ((True, 64), (False, 64), (True, 7), (False, 7)):
        engine = _engine(model, groups, num_blocks=blocks, max_batched_tokens=6, max_num_seqs=3, prefix_caching=caching)
        got[caching, blocks] = [r.output_token_ids for r in _serve(engine, prompts, params)]
        assert not caching or engine.stats()["prefix_cache_hits"] > 0
        engine.stop_followers()
    assert got[True, 64] == got[False, 64] == got[True, 7] == got[False, 7]


def test_tp2_on_threads_with_caching_gives_hfs_tokens(llama):
    _, model = llama
    prompts = _shared_prompts()
    refs = [hf_reference(None, [p], NEW, model=model) for p in prompts]

    def body(groups):
        engine = _engine(model, groups, num_blocks=10, max_batched_tokens=6, max_num_seqs=3, prefix_caching=True)
        if groups.world.rank != 0:
            engine.follow()
            return None
        reqs = _serve(engine, prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False))
        engine.stop_followers()
        return reqs, engine.stats()

    reqs, stats = run_ranks(thread_groups(2, 1), body)[0]
    assert stats["prefix_cache_hits"] > 0
    for i, r in enumerate(reqs):
        _assert_hf(r, refs[i], f"tp2 prompt {i}")


def test_metrics_export_the_cache_counters_per_instance():
    """vLLM's names: dist_infer:prefix_cache_{queries,hits}_total (tokens), labelled by instance."""
    from prometheus_client import CollectorRegistry, generate_latest

    from dist_infer.serving.fleet.wire import InstanceStats
    from dist_infer.serving.http.metrics import EngineStatsCollector

    engine_stats = {"prefix_cache_queries": 40, "prefix_cache_hits": 16, "cached_blocks": 3}
    assert InstanceStats.from_dict(engine_stats).as_dict()["prefix_cache_hits"] == 16, "the keys cross the wire"
    stats = {"instances": [dict(engine_stats, engine="0"), {"engine": "1"}]}
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, "m"))
    text = generate_latest(registry).decode()
    assert 'dist_infer:prefix_cache_queries_total{engine="0",model_name="m"} 40.0' in text
    assert 'dist_infer:prefix_cache_hits_total{engine="0",model_name="m"} 16.0' in text
    assert 'dist_infer:prefix_cache_hits_total{engine="1",model_name="m"} 0.0' in text


@pytest.mark.parametrize("offline", [True, False])
def test_the_flag_is_on_by_default_and_reaches_the_engine_options(offline):
    import argparse

    from dist_infer.launch.model_options import add_scheduler_flags, scheduler_options

    p = argparse.ArgumentParser()
    add_scheduler_flags(p, offline=offline)
    assert scheduler_options(p.parse_args([]))["prefix_caching"] is True
    assert scheduler_options(p.parse_args(["--prefix-caching", "off"]))["prefix_caching"] is False
    with pytest.raises(SystemExit):
        p.parse_args(["--prefix-caching", "maybe"])


def test_the_pool_reports_what_it_cached_and_evicted_in_order():
    from dist_infer.engine.block_pool import BlockPool

    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, 11) and pool.register(b, 22)
    assert not pool.register(b, 33), "a cached block is not registered twice"
    assert pool.take_events() == ([11, 22], [])
    assert pool.take_events() == ([], [])
    pool.free([a, b])  # both evictable; b (the tail) first
    pool.allocate()  # the never-used block
    pool.allocate()  # evicts b
    assert pool.take_events() == ([], [22])
    for i in range(100):  # nobody takes them (offline): bounded all the same
        block = pool.allocate()
        pool.register(block, 1000 + i)
        pool.free([block])
    stored, removed = pool.take_events()
    assert len(stored) <= 12 and stored[-1] == 1099 and len(removed) <= 12


def test_without_cache_generated_only_prompt_blocks_are_cached():
    """bf16 prompts (models/fused_decode.py): a block holding generated tokens is not cached, so no
    other prompt takes its fp32-computed keys; the prompt's own blocks are, as ever."""
    for cache_generated, want in ((True, 3), (False, 2)):
        s = _cached_scheduler(cache_generated=cache_generated)
        a = _req("a", list(range(40, 40 + 2 * BS + 2)), max_new=BS)
        s.add(a)
        while not a.finished:
            out = s.schedule()
            _run(s, out)
            if len(a.output_token_ids) >= BS:
                s.finish(a, "length")
        assert s.allocator.num_cached == want, cache_generated

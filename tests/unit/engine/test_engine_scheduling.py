"""The serving engine without processes: the scheduler's bookkeeping, the step plan's wire
format, counter-based sampling, and the step loop on a real small model (one rank, and tp=2 on
threads) under random arrivals, random chunk sizes and a cache too small for everyone, checked
token for token against HF transformers generating each prompt alone."""

from __future__ import annotations

import random

import pytest
import torch

from dist_infer.engine.kv_cache import blocks_for
from dist_infer.engine.request import Request, RequestError
from dist_infer.engine.sampling import RowSampling, SamplingParams, SamplingParamsError, sample_rows
from dist_infer.engine.scheduler import Scheduler, cp_rows_needed
from dist_infer.engine.scheduler_config import SchedulerConfig
from dist_infer.engine.step_plan import KIND_WORK, StepPlan, decode, encode
from dist_infer.parallel.ring.shards import zigzag_chunks
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.engine_streams import serve_stream
from tests.support.hf_compare import prompts_for, steps_agreeing_with_hf
from tests.support.threads import run_ranks, thread_groups


def _request(i: int, prompt_len: int, max_new: int = 4) -> Request:
    return Request(f"r{i}", list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=max_new), seed=0, seq_id=i)


def _finish_step(scheduler: Scheduler, out, token: int = 7) -> None:
    """Pretend the step ran: append a token to every sampled request."""
    for chunk in out.chunks:
        if chunk.sample:
            chunk.request.output_token_ids.append(token)
            scheduler.on_sampled(chunk.request)


# -- the scheduler ------------------------------------------------------------------------------


def test_decodes_go_first_then_prompt_chunks_fill_the_budget():
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batched_tokens=10))
    a, b = _request(0, 3), _request(1, 25)
    s.add(a)
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens, c.sample) for c in out.chunks] == [("r0", 3, True)]
    _finish_step(s, out)
    s.add(b)
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in out.chunks] == [
        ("r0", 3, 1, True),
        ("r1", 0, 9, False),
    ]
    _finish_step(s, out)
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("r0", 4, 1), ("r1", 9, 9)]
    _finish_step(s, out)
    out = s.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens, c.sample) for c in out.chunks] == [
        ("r0", 5, 1, True),
        ("r1", 18, 7, True),
    ], "the last chunk samples the first token"
    assert len(b.block_table) == blocks_for(25, 4)


def test_failed_over_requests_go_first_and_their_step_starts_no_other_prompt():
    """Requests whose instance died (resumed) jump the queue, all of them in one step, and that step
    starts no new prompt beside them, however much budget is left: its length is their clients' gap.
    The new prompt starts the next step; the decodes already running are in both."""
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batched_tokens=64))
    running, new, first, second = _request(0, 3), _request(1, 5), _request(2, 9), _request(3, 6)
    s.add(running)
    _finish_step(s, s.schedule())
    s.add(new)
    for r in (first, second):
        r.resumed = True
        s.add(r)
    assert [r.request_id for r in s.waiting] == ["r3", "r2", "r1"]
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 1), ("r3", 6), ("r2", 9)]
    assert not first.resumed and not second.resumed and s.failover_recomputed_tokens == 15
    _finish_step(s, out)
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 1), ("r3", 1), ("r2", 1), ("r1", 5)]


def test_a_failed_over_tail_taken_over_from_a_mirror_runs_whole_before_other_prompts():
    """A request that resumes running from its mirrored blocks (engine/mirror/store.py take_over) with
    a tail of 5 tokens to compute again: in the next step its tail goes whole, before the running
    prompt that came first, the ITL cap (2 tokens beside the decodes) given to that prompt only, and no
    new prompt starts."""
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batched_tokens=64))
    decode, chunked, new = _request(0, 3), _request(1, 30), _request(2, 5)
    s.add(decode)
    _finish_step(s, s.schedule())
    s.add(chunked)
    _finish_step(s, s.schedule(prefill_cap=2))
    tail = _request(3, 13)
    tail.resumed, tail.num_computed = True, 8
    s.install(tail, [s.allocator.allocate(), s.allocator.allocate()], computed_here=True)
    s.add(new)
    out = s.schedule(prefill_cap=2)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("r0", 4, 1),
        ("r3", 8, 5),
        ("r1", 2, 2),
    ]
    assert not tail.resumed
    _finish_step(s, out)
    out = s.schedule(prefill_cap=2)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 1), ("r3", 1), ("r1", 2)], (
        "the next step: a decode like the others, and the cap holds again"
    )


def test_without_chunking_a_prompt_waits_for_a_step_with_room_or_runs_alone():
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batched_tokens=8, chunked_prefill=False))
    s.add(_request(0, 6))
    s.add(_request(1, 5))
    out = s.schedule()
    assert [c.num_tokens for c in out.chunks] == [6], "6 + 5 > 8: the second prompt waits"
    _finish_step(s, out)
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 1), ("r1", 5)]
    s2 = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batched_tokens=8, chunked_prefill=False))
    s2.add(_request(0, 20))
    assert [c.num_tokens for c in s2.schedule().chunks] == [20], "longer than the budget: runs alone"


def test_max_num_seqs_caps_the_running_set():
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batched_tokens=None, max_num_seqs=2))
    for i in range(3):
        s.add(_request(i, 2))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"] and len(s.waiting) == 1


def test_preemption_frees_the_newest_and_blocks_are_conserved():
    s = Scheduler(SchedulerConfig(num_blocks=6, block_size=4, max_batched_tokens=None, watermark=0.0))
    reqs = [_request(i, 7, max_new=9) for i in range(3)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1", "r2"] and s.num_free_blocks == 0
    _finish_step(s, out)  # 8 tokens each
    out = s.schedule()  # the 8th token's keys still fit the 2 blocks each
    assert not out.preempted and len(out.chunks) == 3
    _finish_step(s, out)
    out = s.schedule()  # the 9th needs a third block each: the newest goes, the two oldest get its blocks
    assert [r.request_id for r in out.preempted] == ["r2"]
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]
    assert reqs[2].status.value == "waiting" and reqs[2].block_table == [] and reqs[2].num_computed == 0
    assert list(s.waiting) == [reqs[2]] and reqs[2].output_token_ids == [7, 7], "it keeps what it generated"
    assert s.num_preemptions == 1
    _finish_step(s, out)
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        assert out.chunks, "the scheduler must always make progress"
        _finish_step(s, out)
        for r in list(s.running):
            if len(r.output_token_ids) >= r.params.max_new_tokens:
                s.finish(r, "length")
        steps += 1
        assert steps < 200
    assert s.num_free_blocks == 6, "every block back on the free list"
    assert all(len(r.output_token_ids) == 9 for r in reqs)


def test_watermark_keeps_blocks_for_running_requests():
    s = Scheduler(SchedulerConfig(num_blocks=10, block_size=4, max_batched_tokens=None, watermark=0.3))
    s.add(_request(0, 19))  # 5 blocks, and still 5 with its first generated token
    _finish_step(s, s.schedule())
    s.add(_request(1, 8))  # 2 blocks: 5 free - 3 watermark = 2, fits
    assert [c.request.request_id for c in s.schedule().chunks] == ["r0", "r1"]
    s.add(_request(2, 4))  # 1 block; 2 free - 3 < 1: waits
    out = s.schedule()
    assert "r2" not in [c.request.request_id for c in out.chunks] and s.waiting[0].request_id == "r2"


def test_in_flight_requests_are_skipped_and_prefill_chunks_pipeline():
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batched_tokens=4))
    a = _request(0, 10)
    s.add(a)
    first = s.schedule()
    second = s.schedule()  # the next chunk needs no sampled token: it may follow at once
    third = s.schedule()
    assert [c.num_tokens for c in first.chunks + second.chunks + third.chunks] == [4, 4, 2]
    assert third.chunks[0].sample and a.in_flight
    assert s.schedule().chunks == [], "waiting for its sampled token"
    _finish_step(s, third)
    assert [c.num_tokens for c in s.schedule().chunks] == [1]


def test_abort_anywhere_frees_its_blocks():
    s = Scheduler(SchedulerConfig(num_blocks=20, block_size=4, max_batched_tokens=None))
    a, b = _request(0, 9), _request(1, 3)
    s.add(a)
    s.schedule()
    s.add(b)
    s.finish(b, "abort")  # still waiting
    s.finish(a, "abort")  # running, its token in flight
    assert s.num_free_blocks == 20 and not s.has_unfinished() and a.finish_reason == "abort"
    assert [r.request_id for r in s.schedule().freed] == ["r0"], "ranks are told which sequences to forget"


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_rows_bound_covers_every_ranks_shard(cp):
    from dist_infer.models.cp_attention import cp_decode_owner

    for prompt in range(1, 80):
        for generated in (0, 1, 5, 17):
            for rank in range(cp):
                rows = zigzag_chunks(prompt, cp, rank).num_rows
                rows += sum(cp_decode_owner(prompt + t, prompt, cp) == rank for t in range(generated))
                assert rows <= cp_rows_needed(prompt, generated, cp), (prompt, generated, rank)


# -- the step plan ------------------------------------------------------------------------------


def test_step_plan_round_trips():
    plan = StepPlan(
        kind=KIND_WORK,
        step=12,
        seq_ids=[4, 9],
        num_tokens=[1, 5],
        starts=[17, 0],
        block_tables=[[3, 8], [1]],
        sample=[True, False],
        rows=[RowSampling(0.7, 5, 0.9, 2**52 + 1, 3, 2)],
        input_ids=[5, 6, 7, 8, 9, 10],
        prompt_tokens=[0, 5],  # a decode, and a prompt's first chunk
        freed=[2, 3],
        return_logits=True,
    )
    back = decode(*encode(plan))
    assert back == plan
    empty = StepPlan(kind=0, step=3)
    assert decode(*encode(empty)) == empty


# -- sampling -------------------------------------------------------------------------------------


def test_seeded_rows_draw_the_same_token_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    rows = [RowSampling(temperature=1.3, top_k=20, top_p=0.95, seed=11 + i, index=i) for i in range(5)]
    alone = [int(sample_rows(logits[i : i + 1], [rows[i]]).tokens[0]) for i in range(5)]
    together = sample_rows(logits, rows).tokens.tolist()
    shuffled = sample_rows(logits[[4, 2, 0, 3, 1]], [rows[i] for i in (4, 2, 0, 3, 1)]).tokens.tolist()
    assert together == alone and shuffled == [alone[i] for i in (4, 2, 0, 3, 1)]
    other_seed = [RowSampling(temperature=1.3, seed=999, index=i) for i in range(5)]
    assert sample_rows(logits, other_seed).tokens.tolist() != together


def test_top_logprobs_are_the_best_alternatives():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    s = sample_rows(logits, [RowSampling(logprobs=2)])
    assert s.tokens.tolist() == [1] and s.top_ids.tolist() == [[1, 3]]
    assert torch.allclose(s.top_logprobs[0, 0], torch.log_softmax(logits.double(), -1)[0, 1])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"min_tokens": 9, "max_new_tokens": 4}, "min_tokens"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


# -- the step loop on a real model ----------------------------------------------------------------

NEW = 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("engine"), "llama-gqa")
    return path, load_hf_model(path)


def _engine(model, groups, **kw):
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    return Engine(stage_from_hf_model(model, groups), groups, EngineConfig(block_size=4, **kw))


@pytest.mark.parametrize("budget,blocks", [(7, 64), (5, 9), (13, 7)])
def test_random_arrivals_chunks_and_preemption_give_hfs_tokens(llama, budget, blocks):
    path, model = llama
    rng = random.Random(budget * 100 + blocks)
    prompts = prompts_for([rng.randint(3, 17) for _ in range(6)], seed=budget)
    refs = [hf_reference(None, [p], NEW, model=model) for p in prompts]
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups, num_blocks=blocks, max_batched_tokens=budget, max_num_seqs=4)
    arrivals = [rng.randint(0, 8) for _ in prompts]
    reqs = serve_stream(engine, prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False), arrivals)
    for i, r in enumerate(reqs):
        (want,), (want_logits,) = refs[i]
        assert r.finish_reason == "length"
        steps_agreeing_with_hf(r.output_token_ids, want, want_logits, f"budget {budget} blocks {blocks} prompt {i}")
    assert engine.stats()["free_blocks"] == blocks, "KV blocks conserved"
    if blocks < 10:
        assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for everyone"
    engine.stop_followers()


def test_seeded_sampling_is_the_same_alone_and_batched(llama):
    _, model = llama
    prompts = prompts_for([5, 11, 8, 3], seed=5)
    params = [
        SamplingParams(max_new_tokens=8, temperature=0.9, top_k=30, top_p=0.95, seed=100 + i, stop_at_eos=False)
        for i in range(len(prompts))
    ]
    (groups,) = thread_groups(1, 1)

    def run(indices, budget, blocks):
        engine = _engine(model, groups, num_blocks=blocks, max_batched_tokens=budget)
        reqs = [engine.add_request(f"s{i}", prompts[i], params[i]) for i in indices]
        while engine.has_unfinished():
            engine.step()
        engine.stop_followers()
        return {i: r.output_token_ids for i, r in zip(indices, reqs)}

    alone = {}
    for i in range(len(prompts)):
        alone.update(run([i], None, 64))
    assert run(range(4), 3, 64) == alone, "batched, chunked by 3"
    assert run([3, 1, 0, 2], 7, 8) == alone, "another order, another chunk size, preemption"


def test_tp2_on_threads_with_chunks_gives_hfs_tokens(llama):
    _, model = llama
    prompts = prompts_for([9, 4, 14], seed=3)
    refs = [hf_reference(None, [p], NEW, model=model) for p in prompts]

    def body(groups):
        engine = _engine(model, groups, num_blocks=32, max_batched_tokens=6)
        if groups.world.rank != 0:
            engine.follow()
            return None
        reqs = serve_stream(engine, prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False), [0, 1, 3])
        engine.stop_followers()
        return [r.output_token_ids for r in reqs]

    got = run_ranks(thread_groups(2, 1), body)[0]
    for i, ids in enumerate(got):
        (want,), (want_logits,) = refs[i]
        steps_agreeing_with_hf(ids, want, want_logits, f"tp2 prompt {i}")


def test_requests_the_engine_cannot_take_name_the_field(llama):
    _, model = llama
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups, num_blocks=8)
    cases = [
        ([], "prompt", "empty"),
        ([1, 10**6], "prompt", "outside the vocabulary"),
        ([5] * 10, "max_tokens", "KV blocks"),
    ]
    for prompt, field, needle in cases:
        with pytest.raises(RequestError, match=needle) as info:
            engine.add_request("x", prompt, SamplingParams(max_new_tokens=30))
        assert info.value.field == field
    with pytest.raises(RequestError, match="positions") as info:
        engine.add_request("y", [5], SamplingParams(max_new_tokens=engine.cfg.max_positions))
    assert info.value.field == "max_tokens"


def test_static_batching_admits_only_when_the_batch_is_done():
    s = Scheduler(
        SchedulerConfig(
            num_blocks=100, block_size=4, max_batched_tokens=None, static_batching=True, chunked_prefill=False
        )
    )
    s.add(_request(0, 3, max_new=2))
    s.add(_request(1, 4, max_new=2))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"], "one batch of everything waiting"
    _finish_step(s, out)
    s.add(_request(2, 3))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"], "r2 waits for the batch"
    _finish_step(s, out)
    for r in list(s.running):
        s.finish(r, "length")
    assert [c.request.request_id for c in s.schedule().chunks] == ["r2"]


def test_context_parallel_steps_alternate_so_new_prompts_join():
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batched_tokens=None, whole_prompt_steps=True), cp=2)
    a = _request(0, 9, max_new=50)
    s.add(a)
    out = s.schedule()
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 9)]
    _finish_step(s, out)
    s.add(_request(1, 6))
    kinds = []
    for _ in range(4):
        out = s.schedule()
        kinds.append(sorted((c.request.request_id, c.num_tokens) for c in out.chunks))
        assert all(c.num_tokens == 1 for c in out.chunks) or all(c.start == 0 for c in out.chunks), (
            "a cp step is all decodes or all fresh prompts"
        )
        _finish_step(s, out)
    assert kinds[0] == [("r1", 6)] or kinds[1] == [("r1", 6)], f"r1 must join early, not after r0 ends: {kinds}"


def test_a_batch_with_one_seed_gives_each_request_its_own_stream(llama):
    _, model = llama
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    same = [[5, 6, 7]] * 4
    outs = engine.generate(same, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, stop_at_eos=False))
    assert len({tuple(o.token_ids) for o in outs}) > 1, "identical prompts, one seed: still different draws"
    again = engine.generate(same, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, stop_at_eos=False))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_min_tokens_holds_back_eos(llama):
    """EOS cannot be sampled below min_tokens (stop strings are the front end's: tests/unit/serving/http/test_detokenizer.py)."""
    _, model = llama
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups, num_blocks=64)
    eos = next(iter(engine.cfg.eos_token_ids))
    logits = torch.zeros(1, engine.cfg.vocab_size)
    logits[0, eos] = 10.0
    row = RowSampling.of(SamplingParams(min_tokens=2), 0, 0)
    assert int(sample_rows(logits, [row], (eos,)).tokens[0]) != eos
    assert int(sample_rows(logits, [RowSampling.of(SamplingParams(min_tokens=2), 0, 2)], (eos,)).tokens[0]) == eos


def test_context_parallel_decodes_go_on_while_a_prompt_waits_for_blocks():
    s = Scheduler(
        SchedulerConfig(num_blocks=9, block_size=4, max_batched_tokens=7, whole_prompt_steps=True, watermark=0.0), cp=2
    )
    for i in range(3):
        s.add(_request(i, 16, max_new=6))
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        assert out.chunks, f"stuck at step {steps}: waiting {[r.request_id for r in s.waiting]}"
        _finish_step(s, out)
        for r in list(s.running):
            if len(r.output_token_ids) >= r.params.max_new_tokens:
                s.finish(r, "length")
        steps += 1
        assert steps < 100
    assert s.num_free_blocks == 9


def test_offline_cache_grows_for_a_longer_batch(llama):
    """Offline, the cache is sized per batch: a long prompt after a short batch (bench's warm-up
    then its timed run) gets a bigger cache, not an error about the old one."""
    path, model = llama
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    short, long = prompts_for([3, 60], seed=7)
    params = SamplingParams(max_new_tokens=2, stop_at_eos=False)
    engine.generate([short], params)
    small = engine.num_blocks
    (out,) = engine.generate([long], params)
    assert engine.num_blocks > small and len(out.token_ids) == 2


def test_offline_timing_has_a_gap_per_later_token_and_their_median(llama):
    """`tpot_median_s` (what `bench --sweep` sets against the predicted decode step) is the median of
    every sequence's gaps between successive tokens: one per token after its first."""
    import statistics

    _, model = llama
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups, max_batched_tokens=8)  # the 3 prompts' prefill takes several steps
    engine.generate(prompts_for([5, 7, 9], seed=1), SamplingParams(max_new_tokens=NEW, stop_at_eos=False))
    timing = engine.timing
    assert len(timing.token_gaps_s) == 3 * (NEW - 1)
    assert all(g > 0 for g in timing.token_gaps_s)
    assert timing.as_dict()["tpot_median_s"] == statistics.median(timing.token_gaps_s)
    assert min(timing.token_gaps_s) <= timing.as_dict()["tpot_median_s"] <= max(timing.token_gaps_s)


def test_an_itl_target_cuts_prompt_chunks_beside_decodes_and_keeps_hfs_tokens(llama):
    """A 1 us target (below any step's cost) cuts every chunk beside running decodes to the minimum (16), once
    the engine has timed a decode step and a prompt; tokens stay HF's and the step kinds are counted."""
    from dist_infer.engine.step_cost import MIN_CHUNK

    path, model = llama
    prompts = prompts_for([5, 40, 45, 50], seed=3)
    refs = [hf_reference(None, [p], NEW, model=model) for p in prompts]
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups, num_blocks=64, max_batched_tokens=64, max_num_seqs=4, itl_target="0.001")
    shapes, schedule = [], engine.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        shapes.append([c.num_tokens for c in out.chunks])
        return out

    engine.scheduler.schedule = recording
    reqs = serve_stream(engine, prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False), [0, 0, 4, 5])
    for i, r in enumerate(reqs):
        (want,), (want_logits,) = refs[i]
        steps_agreeing_with_hf(r.output_token_ids, want, want_logits, f"itl target prompt {i}")
    assert engine.pacer.step_costs.ready
    mixed = [s for s in shapes if 1 in s and any(n > 1 for n in s)]
    assert mixed and all(sum(n for n in s if n > 1) <= MIN_CHUNK for s in mixed[1:]), shapes
    kinds = {k: sum(counts) for k, (_, counts, _) in engine.stats()["step_seconds"].items()}
    assert kinds["decode"] > 0 and kinds["mixed"] > 0 and kinds["prefill"] > 0, kinds
    assert engine.stats()["free_blocks"] == 64
    engine.stop_followers()

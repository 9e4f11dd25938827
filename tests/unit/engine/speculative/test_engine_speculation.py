"""Speculative decoding in the step loop on real small models, against HF transformers and against
the same engine without it: greedy ids identical and logits within fp32 tolerance (one rank, tp=2 on
threads, an MoE model; beside prompt chunks, with prefix caching, preemption and a tiny cache);
seeded sampling emits the very tokens, logprobs and top logprobs plain sampling does; proposals
were made and accepted in each run (or the run would prove nothing), and every KV block comes back.

The prompts repeat themselves, and these random models fall into loops, so prompt lookup finds
matches; a model that never repeats would leave these runs without proposals (checked)."""

from __future__ import annotations

import random

import pytest

from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.speculative.config import SpeculativeConfig
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.engine_streams import serve_stream
from tests.support.hf_compare import assert_outputs_match_hf, steps_agreeing_with_hf
from tests.support.threads import run_ranks, thread_groups

NEW = 24
# K fixed: an adaptive K follows the step costs the engine measures (its clock), so what it proposes, and
# whether any proposal is accepted, would depend on the machine's load; the adaptive one runs below too
SPEC = SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3, adaptive=False)
ADAPTIVE = SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3)


def _prompts(seed: int, n: int = 4) -> list[list[int]]:
    """Prompts that repeat a phrase of theirs, so lookup has something to find from the start."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 120) for _ in range(rng.randint(3, 6))]
        out.append([rng.randrange(3, 120) for _ in range(rng.randint(1, 5))] + phrase * rng.randint(2, 3) + phrase[:2])
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("spec"), "llama-gqa")
    return path, load_hf_model(path)


def _engine(model, groups, spec=SPEC, **kw):
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    return Engine(stage_from_hf_model(model, groups), groups, EngineConfig(block_size=4, speculative=spec, **kw))


def _accepted(engine) -> int:
    snap = engine.speculative.snapshot()
    assert snap["num_draft_tokens"] > 0, "no proposals were made: the run checks nothing"
    return snap["num_accepted_tokens"]


def test_greedy_equals_hf_ids_and_logits(llama):
    path, model = llama
    prompts = _prompts(1)
    ids, logits = hf_reference(path, prompts, NEW)
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW), return_logits=True)
    assert_outputs_match_hf(outputs, prompts, ids, logits, "speculative greedy")
    assert _accepted(engine) > 0
    assert engine.stats()["free_blocks"] == engine.num_blocks
    engine.stop_followers()


@pytest.mark.parametrize("budget,blocks,caching", [(7, 64, True), (9, 16, True), (5, 14, False)])
def test_arrivals_chunks_prefix_caching_and_preemption_keep_hfs_ids(llama, budget, blocks, caching):
    path, model = llama
    rng = random.Random(budget * 7 + blocks)
    prompts = _prompts(budget, 5)
    prompts.append(list(prompts[0]))  # the same prompt again: a prefix-cache hit
    refs = [hf_reference(None, [p], NEW, model=model) for p in prompts]
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups, num_blocks=blocks, max_batched_tokens=budget, prefix_caching=caching)
    arrivals = [rng.randint(0, 10) for _ in prompts]
    reqs = serve_stream(engine, prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False), arrivals)
    for i, r in enumerate(reqs):
        (want,), (want_logits,) = refs[i]
        assert r.finish_reason == "length" and len(r.output_token_ids) == NEW
        steps_agreeing_with_hf(r.output_token_ids, want, want_logits, f"budget {budget} blocks {blocks} prompt {i}")
    assert _accepted(engine) > 0
    stats = engine.stats()
    assert stats["free_blocks"] == blocks, "KV blocks conserved"
    if blocks < 20:
        assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for everyone"
    engine.stop_followers()


def test_tp2_on_threads_equals_hf(llama):
    _, model = llama
    prompts = _prompts(3, 3)
    refs = [hf_reference(None, [p], NEW, model=model) for p in prompts]

    def body(groups):
        engine = _engine(model, groups, num_blocks=48, max_batched_tokens=8)
        if groups.world.rank != 0:
            engine.follow()
            return None
        reqs = serve_stream(engine, prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False), [0, 1, 4])
        engine.stop_followers()
        return [r.output_token_ids for r in reqs], _accepted(engine)

    got, accepted = run_ranks(thread_groups(2, 1), body)[0]
    assert accepted > 0
    for i, ids in enumerate(got):
        (want,), (want_logits,) = refs[i]
        steps_agreeing_with_hf(ids, want, want_logits, f"tp2 speculative prompt {i}")


def test_moe_greedy_equals_hf(tmp_path):
    path = write_hf_checkpoint(tmp_path, "mixtral")
    model = load_hf_model(path)
    prompts = _prompts(5, 3)
    ids, logits = hf_reference(path, prompts, NEW)
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW), return_logits=True)
    assert_outputs_match_hf(outputs, prompts, ids, logits, "speculative MoE greedy")
    _accepted(engine)
    engine.stop_followers()


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.8, top_k=20, top_p=0.9, logprobs=3),
        dict(temperature=1.2, min_tokens=10),
        dict(temperature=0.0, logprobs=2),
    ],
)
def test_seeded_sampling_emits_plain_samplings_tokens(llama, params):
    _, model = llama
    prompts = _prompts(9, 4)
    (groups,) = thread_groups(1, 1)

    def run(spec):
        engine = _engine(model, groups, spec=spec, num_blocks=64, max_batched_tokens=16)
        reqs = [
            engine.add_request(
                f"s{i}", p, SamplingParams(max_new_tokens=NEW, seed=100 + i, stop_at_eos=False, **params)
            )
            for i, p in enumerate(prompts)
        ]
        while engine.has_unfinished():
            engine.step()
        engine.stop_followers()
        return [(r.output_token_ids, r.output_logprobs, r.output_top_logprobs) for r in reqs], engine

    plain, _ = run(None)
    for spec in (ADAPTIVE, SpeculativeConfig(num_tokens=8, ngram_min=1, ngram_max=1, adaptive=False)):
        got, engine = run(spec)
        _accepted(engine)
        for i, ((ids, lps, tops), (want_ids, want_lps, want_tops)) in enumerate(zip(got, plain)):
            assert ids == want_ids, f"prompt {i}: {ids} vs plain {want_ids}"
            assert lps == pytest.approx(want_lps, abs=1e-5)
            for mine, theirs in zip(tops, want_tops):
                assert [t for t, _ in mine] == [t for t, _ in theirs]
                assert [lp for _, lp in mine] == pytest.approx([lp for _, lp in theirs], abs=1e-5)

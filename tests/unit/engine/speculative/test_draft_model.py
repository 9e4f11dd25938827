"""A draft model's proposals (`--speculative draft`), on real small models in one process and at
tp=2 on threads: whatever the draft says, the output is HF's greedy ids and logits and plain
sampling's seeded tokens; a draft equal to the model is always accepted, a different one sometimes;
a long prompt is caught up over several steps; the draft's own blocks all come back; a draft of
another vocabulary is refused by the flag's name."""

from __future__ import annotations

import pytest

from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.speculative.config import SpeculativeConfig
from dist_infer.engine.speculative.draft_model import CATCH_UP, DraftModelError
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.hf_compare import assert_outputs_match_hf, prompts_for, steps_agreeing_with_hf
from tests.support.threads import run_ranks, thread_groups

NEW = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = write_hf_checkpoint(root, "llama-gqa", subdir="target", max_position_embeddings=512)
    other = write_hf_checkpoint(
        root, "llama-gqa", subdir="other", seed=7, num_hidden_layers=1, max_position_embeddings=512
    )
    return target, load_hf_model(target), other


def _engine(model, groups, draft, **kw):
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    spec = SpeculativeConfig(method="draft", draft_model=str(draft), num_tokens=4)
    return Engine(stage_from_hf_model(model, groups), groups, EngineConfig(block_size=4, speculative=spec, **kw))


@pytest.mark.parametrize("which", ["itself", "other"])
def test_greedy_equals_hf_whatever_the_draft(models, which):
    target, model, other = models
    prompts = prompts_for([5, 17, 9], seed=4)
    ids, logits = hf_reference(target, prompts, NEW, model=model)
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups, target if which == "itself" else other, num_blocks=64)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW), return_logits=True)
    assert_outputs_match_hf(outputs, prompts, ids, logits, f"draft {which}")
    snap = engine.speculative.snapshot()
    assert snap["num_draft_tokens"] > 0
    if which == "itself":
        assert snap["num_accepted_tokens"] == snap["num_draft_tokens"], "a draft equal to the model is always right"
    drafter = engine.scheduler.drafter
    assert drafter.pool.num_free == 64 and len(drafter._sequences) == 0, "the draft's blocks all came back"
    engine.stop_followers()


def test_seeded_sampling_is_plain_samplings_and_a_long_prompt_catches_up(models):
    target, model, _ = models
    prompts = prompts_for([CATCH_UP + 40, 7], seed=8)
    (groups,) = thread_groups(1, 1)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_k=20, seed=5, stop_at_eos=False)

    def run(engine):
        reqs = [engine.add_request(f"s{i}", p, params) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        engine.stop_followers()
        return [r.output_token_ids for r in reqs]

    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    plain = run(Engine(stage_from_hf_model(model, groups), groups, EngineConfig(block_size=4, num_blocks=128)))
    engine = _engine(model, groups, target, num_blocks=128, max_batched_tokens=64)
    assert run(engine) == plain
    assert engine.speculative.snapshot()["num_draft_tokens"] > 0


def test_tp2_target_with_a_draft_on_the_driver_equals_hf(models):
    target, model, other = models
    prompts = prompts_for([6, 11], seed=2)
    refs = [hf_reference(None, [p], NEW, model=model) for p in prompts]

    def body(groups):
        engine = _engine(model, groups, target, num_blocks=48)
        if groups.world.rank != 0:
            assert engine.scheduler.drafter is None, "the draft lives on the driver only"
            engine.follow()
            return None
        reqs = [engine.add_request(f"t{i}", p, SamplingParams(max_new_tokens=NEW)) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        engine.stop_followers()
        return [r.output_token_ids for r in reqs], engine.speculative.snapshot()["num_accepted_tokens"]

    got, accepted = run_ranks(thread_groups(2, 1), body)[0]
    assert accepted > 0
    for i, ids in enumerate(got):
        (want,), (want_logits,) = refs[i]
        steps_agreeing_with_hf(ids, want, want_logits, f"tp2 draft prompt {i}")


def test_a_draft_of_another_vocabulary_is_refused_by_name(models, tmp_path):
    _, model, _ = models
    wrong = write_hf_checkpoint(tmp_path, "llama-gqa", subdir="wrong", vocab_size=64)
    (groups,) = thread_groups(1, 1)
    with pytest.raises(DraftModelError, match="--draft-model .*vocabulary has 64 tokens"):
        _engine(model, groups, wrong, num_blocks=16)


def test_draft_needs_its_model_and_ngram_takes_none():
    with pytest.raises(ValueError, match="--draft-model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="--draft-model"):
        SpeculativeConfig(method="ngram", draft_model="x")

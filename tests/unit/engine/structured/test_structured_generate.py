"""Structured outputs through the engine on a small random Llama with a real tokenizer: random JSON
schemas give outputs that parse and validate (greedy and sampled), a request's output is the same
alone, batched beside others, chunked, preempted and recomputed, resumed from its ids, and under
tp=2; a bad spec is refused before anything is queued; unconstrained requests are untouched."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dist_infer.engine.engine_core import Engine, EngineConfig
from dist_infer.engine.request import Request
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.step_plan import KIND_WORK
from dist_infer.engine.structured.spec import StructuredSpec, StructuredSpecError
from dist_infer.engine.tokenizer import TextTokenizer
from dist_infer.models.loader import load_stage
from tests.support.threads import run_ranks, thread_groups

PROMPTS = [[0, 17, 90, 301, 44], [0, 250, 12], [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def build(path, groups, **config) -> Engine:
    stage, _ = load_stage(path, groups)
    options = dict(block_size=4, num_blocks=256) | config
    return Engine(stage, groups, EngineConfig(**options), tokenizer=lambda: TextTokenizer(path))


@pytest.fixture(scope="module")
def engine(small_checkpoint):
    (groups,) = thread_groups(1, 1)
    eng = build(small_checkpoint, groups)
    yield eng
    eng.stop_followers()


def serve(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[Request]:
    """Add every request, step until all are done."""
    added = [engine.add_request(f"r{engine.stats()['requests_added']}-{i}", p, s) for i, (p, s) in enumerate(requests)]
    for _ in range(5000):
        if not engine.has_unfinished():
            return added
        engine.step()
    raise AssertionError("the requests did not finish")


def structured(schema: dict, **kw) -> SamplingParams:
    kw = dict(max_new_tokens=160) | kw
    return SamplingParams(structured=StructuredSpec.from_kind("json_schema", schema), **kw)


def assert_valid(engine: Engine, tokenizer: TextTokenizer, r: Request, schema: dict) -> None:
    """A finished output parses and validates; one cut by its length is a prefix the grammar takes."""
    import jsonschema

    ids = r.output_token_ids
    if r.finish_reason == "stop":
        text = tokenizer.decode([t for t in ids if t not in engine.cfg.eos_token_ids])
        jsonschema.validate(json.loads(text), schema)
    else:
        assert r.finish_reason == "length", r.finish_reason
        engine.grammars.matcher(r.params.structured, ids)  # GrammarRejected if it were not a prefix


# -- random schemas ------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "id", "ok", "name", "x1"])


def leaf_schemas():
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    )
    string = st.integers(0, 5).map(lambda n: {"type": "string", "maxLength": n})
    enum = st.lists(st.sampled_from(["red", "green", "x", "", "a b"]), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}
    )
    return st.one_of(integer, string, enum, st.just({"type": "boolean"}))


def containers(children):
    array = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    obj = st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": sorted(required),
                "additionalProperties": False,
            }
        )
    )
    return st.one_of(array, obj)


SCHEMAS = st.recursive(leaf_schemas(), containers, max_leaves=6)


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schema=SCHEMAS)
def test_random_schemas_give_outputs_that_validate(engine, text_tokenizer, schema):
    requests = [(PROMPTS[0], structured(schema)), (PROMPTS[1], structured(schema, temperature=1.0, seed=7))]
    for r in serve(engine, requests):
        assert_valid(engine, text_tokenizer, r, schema)


def test_outputs_are_the_same_alone_batched_chunked_and_preempted(small_checkpoint, engine, text_tokenizer):
    short = dict(max_new_tokens=60)  # within what the small cache below can hold for one request
    params = [
        structured(SCHEMA, **short),
        structured(SCHEMA, temperature=1.0, seed=3, **short),
        SamplingParams(**short),
    ]
    alone = [serve(engine, [(PROMPTS[i], params[i])])[0].output_token_ids for i in range(3)]
    batched = serve(engine, [(PROMPTS[i], params[i]) for i in range(3)])
    assert [r.output_token_ids for r in batched] == alone
    for r in batched[:2]:
        assert r.finish_reason == "stop"
        assert_valid(engine, text_tokenizer, r, SCHEMA)
    (groups,) = thread_groups(1, 1)
    tight = build(small_checkpoint, groups, num_blocks=18, max_batched_tokens=5, max_num_seqs=3)
    squeezed = serve(tight, [(PROMPTS[i], params[i]) for i in range(3)])
    assert tight.scheduler.num_preemptions > 0, "the cache was meant to be too small for all three"
    assert [r.output_token_ids for r in squeezed] == alone, "chunked by 5 and recomputed after preemption"
    tight.stop_followers()


def test_prefix_cache_hits_and_layered_prefill_give_the_same_outputs(small_checkpoint, engine):
    params = [structured(SCHEMA), structured(SCHEMA, temperature=1.0, seed=9)]
    want = [r.output_token_ids for r in serve(engine, list(zip(PROMPTS[1:], params)))]
    (groups,) = thread_groups(1, 1)
    cached = build(small_checkpoint, groups, prefix_caching=True)
    for _ in range(2):  # the second time from the cached prompt blocks
        assert [r.output_token_ids for r in serve(cached, list(zip(PROMPTS[1:], params)))] == want
    assert cached.scheduler.allocator.num_evictable > 0, "blocks were cached"
    layered = build(small_checkpoint, groups, prefill_schedule="layered", max_batched_tokens=4)
    assert [r.output_token_ids for r in serve(layered, list(zip(PROMPTS[1:], params)))] == want
    for eng in (cached, layered):
        eng.stop_followers()


def test_a_resumed_request_goes_on_from_its_ids(engine):
    params = structured(SCHEMA, temperature=0.8, seed=11)
    (whole,) = serve(engine, [(PROMPTS[2], params)])
    ids = whole.output_token_ids
    assert len(ids) > 6
    progress = SimpleNamespace(token_ids=ids[:5], logprobs=whole.output_logprobs[:5], top_logprobs=[], age_s=0.0)
    progress.first_token_age_s = 0.0
    r = engine.resume_request("resumed", PROMPTS[2], params, progress)
    while engine.has_unfinished():
        engine.step()
    assert r.output_token_ids == ids and r.finish_reason == whole.finish_reason


def test_a_migrated_request_rebuilds_its_grammar_and_goes_on_identically(small_checkpoint, engine):
    """The destination's side of a migration (engine/migration.py commit_in) without the KV transfer:
    what travels is MigratingRequest (no grammar state), the destination rebuilds it from the ids."""
    from dist_infer.engine.migration import MigratingRequest

    params = structured(SCHEMA, temperature=0.7, seed=21)
    (whole,) = serve(engine, [(PROMPTS[0], params)])
    (groups,) = thread_groups(1, 1)
    source, destination = build(small_checkpoint, groups), build(small_checkpoint, groups)
    r = source.add_request("moving", PROMPTS[0], params)
    while len(r.output_token_ids) < 6:
        source.step()
    source.scheduler.pause(r)
    state = MigratingRequest.of(r, send_kv=False)
    source.hand_over(r)
    moved = state.to_request()
    assert moved.grammar is None, "the grammar state does not travel"
    destination.start_grammar(moved)
    destination.adopt(moved, [])
    while destination.has_unfinished():
        destination.step()
    assert moved.output_token_ids == whole.output_token_ids and moved.finish_reason == "stop"
    for eng in (source, destination):
        eng.stop_followers()


def test_choices_regexes_and_grammars_end_when_complete(engine, text_tokenizer):
    cases = [
        (
            StructuredSpec.from_kind("choice", ["the river", "the town", "snow"]),
            lambda t: t in ("the river", "the town", "snow"),
        ),
        (StructuredSpec.from_kind("regex", "[0-9]{3}-[a-z]{2}"), lambda t: len(t) == 6 and t[3] == "-"),
        (
            StructuredSpec.from_kind("lark", 'start: "(" item ("," item)* ")"\nitem: /[xy]{1,3}/'),
            lambda t: t[0] == "(" and t[-1] == ")",
        ),
        (StructuredSpec.from_kind("ebnf", 'root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),
    ]
    for spec, ok in cases:
        (r,) = serve(engine, [(PROMPTS[0], SamplingParams(max_new_tokens=40, structured=spec))])
        text = text_tokenizer.decode(r.output_token_ids)
        assert r.finish_reason == "stop" and ok(text), (spec, text)


def test_without_eos_stops_a_finished_grammar_still_ends_the_request(engine, text_tokenizer):
    spec = StructuredSpec.from_kind("regex", "[0-9]{1,3}")
    (r,) = serve(engine, [(PROMPTS[1], SamplingParams(max_new_tokens=30, stop_at_eos=False, structured=spec))])
    text = text_tokenizer.decode([t for t in r.output_token_ids if t not in engine.cfg.eos_token_ids])
    assert r.finish_reason == "stop" and text.isdigit() and len(text) <= 3


def test_min_tokens_cannot_hold_a_finished_grammar_open(engine, text_tokenizer):
    spec = StructuredSpec.from_kind("choice", ["snow"])
    (r,) = serve(engine, [(PROMPTS[0], SamplingParams(max_new_tokens=30, min_tokens=20, structured=spec))])
    assert r.finish_reason == "stop" and text_tokenizer.decode(r.output_token_ids) == "snow"


@pytest.mark.parametrize(
    "spec,field",
    [
        (StructuredSpec.from_kind("regex", "a(b"), "regex"),
        (StructuredSpec.from_kind("lark", "start: nowhere"), "lark"),
        (StructuredSpec.from_kind("json_schema", {"type": "integer", "minimum": "x"}), "json_schema"),
    ],
)
def test_a_bad_spec_is_refused_before_it_is_queued(engine, spec, field):
    added = engine.stats()["requests_added"]
    with pytest.raises(StructuredSpecError) as info:
        engine.add_request("bad", PROMPTS[0], SamplingParams(structured=spec))
    assert info.value.field == field
    assert not engine.has_unfinished() and engine.stats()["requests_added"] == added
    with pytest.raises(StructuredSpecError):
        engine.generate([PROMPTS[0]], SamplingParams(structured=spec))


def test_an_engine_without_a_tokenizer_refuses_structured_requests(small_checkpoint):
    (groups,) = thread_groups(1, 1)
    stage, _ = load_stage(small_checkpoint, groups)
    bare = Engine(stage, groups, EngineConfig(block_size=4, num_blocks=16))
    with pytest.raises(StructuredSpecError, match="no tokenizer"):
        bare.add_request("x", PROMPTS[0], SamplingParams(structured=StructuredSpec.from_kind("json_object")))
    assert len(bare.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3


def test_offline_generate_takes_a_spec(engine, text_tokenizer):
    params = SamplingParams(max_new_tokens=80, structured=StructuredSpec.from_kind("json_object"))
    for out in engine.generate(PROMPTS, params):
        text = text_tokenizer.decode([t for t in out.token_ids if t not in engine.cfg.eos_token_ids])
        if out.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


def test_tp2_on_threads_gives_the_single_rank_output(small_checkpoint, engine):
    params = [structured(SCHEMA), structured(SCHEMA, temperature=1.0, seed=5)]
    want = [r.output_token_ids for r in serve(engine, list(zip(PROMPTS[:2], params)))]

    def body(groups):
        eng = build(small_checkpoint, groups, max_batched_tokens=6)
        if groups.world.rank != 0:
            eng.follow()
            return None
        got = [r.output_token_ids for r in serve(eng, list(zip(PROMPTS[:2], params)))]
        eng.stop_followers()
        return got

    assert run_ranks(thread_groups(2, 1), body)[0] == want


def test_only_steps_that_sample_a_constrained_row_carry_masks(engine, monkeypatch):
    plans = []
    run = engine.runner.run

    def spy(plan, *args, **kwargs):
        pending = plan.pending_masks  # the driver samples: its masks are computed beside the forward
        assert not plan.mask_rows and plan.masks is None, "none filled before the plan leaves"
        out = run(plan, *args, **kwargs)
        if plan.kind == KIND_WORK:
            assert plan.pending_masks is None and (pending is not None) == bool(plan.mask_rows)
            plans.append((list(plan.sample), list(plan.mask_rows), plan.masks))
        return out

    monkeypatch.setattr(engine.runner, "run", spy)
    spec = StructuredSpec.from_kind("choice", ["snow"])
    serve(engine, [(PROMPTS[0], SamplingParams(max_new_tokens=8)), (PROMPTS[1], SamplingParams(structured=spec))])
    masked = [p for p in plans if p[1]]
    assert masked and all(p[2] is not None and p[2].shape[0] == len(p[1]) for p in masked)
    assert any(not p[1] and p[2] is None for p in plans), "once the constrained request ended: no masks"


def test_a_failing_mask_fails_its_request_alone(engine, monkeypatch):
    def boom(matchers):
        raise RuntimeError("mask exploded")

    monkeypatch.setattr(engine.masks, "fill", boom)
    spec = StructuredSpec.from_kind("json_object")
    plain, constrained = serve(
        engine, [(PROMPTS[0], SamplingParams(max_new_tokens=8)), (PROMPTS[1], SamplingParams(structured=spec))]
    )
    assert constrained.finish_reason == "abort" and plain.finish_reason == "length"
    monkeypatch.undo()
    (alone,) = serve(engine, [(PROMPTS[0], SamplingParams(max_new_tokens=8))])
    assert plain.output_token_ids == alone.output_token_ids
    assert engine.stats()["free_blocks"] == engine.num_blocks, "every block back"


def test_a_token_the_grammar_rejects_fails_the_request_with_the_reason_in_the_log(small_checkpoint):
    from loguru import logger

    from dist_infer.engine.sampling import sample_rows

    def ignores_masks(logits, rows, eos_ids=()):
        out = sample_rows(logits, rows, eos_ids)
        out.tokens[:] = 7  # whatever the grammar allows
        return out

    (groups,) = thread_groups(1, 1)
    stage, _ = load_stage(small_checkpoint, groups)
    eng = Engine(
        stage,
        groups,
        EngineConfig(block_size=4, num_blocks=32),
        sampler=ignores_masks,
        tokenizer=lambda: TextTokenizer(small_checkpoint),
    )
    logs = []
    sink = logger.add(logs.append, level="ERROR")
    logger.enable("dist_infer")
    try:
        (r,) = serve(eng, [(PROMPTS[0], SamplingParams(structured=StructuredSpec.from_kind("regex", "[0-9]+")))])
    finally:
        logger.remove(sink)
        logger.disable("dist_infer")
    assert r.finish_reason == "abort" and r.output_token_ids == []
    assert any("token 7 is not allowed by the grammar" in str(m) for m in logs)


def test_a_structured_request_beside_speculating_ones(small_checkpoint, text_tokenizer):
    """Speculative decoding on: structured requests do not speculate, and their masks land on their
    own rows while other rows of the same steps verify K + 1 positions (the sampled positions shift):
    every output is the one it has with speculation off."""
    from dist_infer.engine.speculative.config import SpeculativeConfig

    (groups,) = thread_groups(1, 1)
    repeat = [0, 40, 41, 42, 40, 41, 42, 40, 41]
    batch = [
        (repeat, SamplingParams(max_new_tokens=60, stop_at_eos=False)),
        (PROMPTS[0], structured(SCHEMA)),
        (repeat[1:], SamplingParams(max_new_tokens=60, stop_at_eos=False, temperature=0.7, seed=3)),
        (PROMPTS[1], structured(SCHEMA, temperature=1.0, seed=4)),
    ]
    runs = []
    for spec in (None, SpeculativeConfig(ngram_min=1)):
        eng = build(small_checkpoint, groups, speculative=spec)
        runs.append(([r.output_token_ids for r in serve(eng, batch)], eng.speculative.snapshot()))
        eng.stop_followers()
    (plain, _), (spec_ids, counts) = runs
    assert spec_ids == plain
    assert counts["num_draft_tokens"] > 0, "the unconstrained rows speculated"
    for r_ids, (_, params) in zip(spec_ids, batch):
        if params.structured is not None:
            json.loads(text_tokenizer.decode(r_ids))

"""The step-cost model the ITL target sizes prompt chunks with, and the scheduler under that cap:
fitted from steps, solved for a target, never starving a prompt. Pure: no model, no processes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dist_infer.engine.request import Request
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.scheduler_config import SchedulerConfig
from dist_infer.engine.step_cost import (
    AUTO_FACTOR,
    AUTO_FLOOR_S,
    FEATURES,
    MIN_CHUNK,
    StepCostModel,
    StepShape,
    StepTimes,
    chunk_pairs,
    parse_itl_target,
    prefill_backlog_s,
)

# a CPU-like truth: 4 ms fixed, 3 ms more for a step with a prompt, 0.1 ms a prompt token, 0.02 ms per 1000 attention pairs, 0.3 ms a decode,
# 0.05 ms per 1000 decode context tokens, 0.2 ms a proposed token verified, 1 ms more for a step with proposals
TRUE = np.array([4e-3, 3e-3, 1e-4, 2e-5, 3e-4, 5e-5, 2e-4, 1e-3])


def true_seconds(shape: StepShape) -> float:
    return float(TRUE @ shape.features())


def _random_shape(rng: random.Random) -> StepShape:
    kind = rng.choice(("decode", "mixed", "prefill"))
    decodes = 0 if kind == "prefill" else rng.randint(1, 32)
    n = 0 if kind == "decode" else rng.randint(16, 512)
    start = rng.randint(0, 2000)
    return StepShape(
        prompt_tokens=n,
        prompt_pairs=chunk_pairs(start, n) if n else 0.0,
        decodes=decodes,
        decode_context=decodes * rng.randint(10, 1500),
        draft_tokens=rng.choice((0, 0, decodes * rng.randint(1, 4))),
    )


def _fitted(truth=TRUE, seed=5) -> StepCostModel:
    """A model taught 200 random steps timed exactly by `truth`."""
    model = StepCostModel()
    rng = random.Random(seed)
    for _ in range(200):
        shape = _random_shape(rng)
        model.observe(shape, float(truth @ shape.features()))
    return model


def test_the_fit_recovers_the_costs_of_a_step():
    model = _fitted(seed=0)
    np.testing.assert_allclose(model.coefficients(), TRUE, rtol=0.02, atol=1e-7)
    shape = StepShape(prompt_tokens=100, prompt_pairs=chunk_pairs(300, 100), decodes=8, decode_context=4000)
    assert model.predict(shape) == pytest.approx(true_seconds(shape), rel=0.01)


def test_noisy_steps_still_give_a_usable_fit():
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(400):
        shape = _random_shape(rng)
        model.observe(shape, true_seconds(shape) * rng.uniform(0.9, 1.1))
    shape = StepShape(prompt_tokens=256, decodes=8, decode_context=2000)
    assert model.predict(shape) == pytest.approx(true_seconds(shape), rel=0.1)


def test_the_chunk_it_picks_fills_the_target_and_no_more():
    model = _fitted(seed=2)
    for decodes, context, start, target in [(8, 3000, 0, 0.03), (32, 40000, 1500, 0.05), (1, 10, 4000, 0.2)]:
        n = model.prompt_tokens_within(target, decodes, context, start)
        at = StepShape(prompt_tokens=n, prompt_pairs=chunk_pairs(start, n), decodes=decodes, decode_context=context)
        over = StepShape(
            prompt_tokens=n + 2, prompt_pairs=chunk_pairs(start, n + 2), decodes=decodes, decode_context=context
        )
        assert true_seconds(at) <= target * 1.01 and true_seconds(over) > target * 0.99, (decodes, start, n)


def test_a_target_the_decodes_alone_miss_still_advances_prompts():
    model = StepCostModel()
    model.observe(StepShape(decodes=8, decode_context=800), 0.05)
    model.observe(StepShape(prompt_tokens=256), 0.03)
    assert model.prompt_tokens_within(0.01, 8, 800, 0) == MIN_CHUNK


def test_nothing_is_capped_before_both_costs_are_seen():
    model = StepCostModel()
    assert model.prompt_tokens_within(0.05, 4, 100, 0) is None
    model.observe(StepShape(decodes=4, decode_context=100), 0.01)
    assert model.prompt_tokens_within(0.05, 4, 100, 0) is None, "no prompt token's cost seen yet"
    model.observe(StepShape(prompt_tokens=100), 0.02)
    assert model.prompt_tokens_within(0.05, 4, 100, 0) is not None


def test_the_fit_follows_a_machine_that_slows_down():
    rng = random.Random(3)
    model = StepCostModel()
    for slow in (1.0, 3.0):
        for _ in range(300):
            shape = _random_shape(rng)
            model.observe(shape, slow * true_seconds(shape))
    shape = StepShape(prompt_tokens=128, decodes=4, decode_context=400)
    assert model.predict(shape) == pytest.approx(3.0 * true_seconds(shape), rel=0.05)


def test_bad_durations_are_ignored():
    model = StepCostModel()
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        model.observe(StepShape(decodes=1), bad)
    assert model.seen == {"decode": 0, "mixed": 0, "prefill": 0}


@pytest.mark.parametrize(
    "text,want",
    [
        ("auto", ("auto", AUTO_FACTOR)),
        ("off", None),
        (None, None),
        ("3x", ("x", 3.0)),
        ("50", ("ms", 50.0)),
        ("12.5ms", ("ms", 12.5)),
    ],
)
def test_itl_target_forms(text, want):
    assert parse_itl_target(text) == want


@pytest.mark.parametrize(
    "text,says",
    [
        ("fast", "expected auto"),
        ("1x", "above 1"),
        ("0", "positive"),
        ("-5", "positive"),
        ("nan", "positive"),
        ("infx", "above 1"),
    ],
)
def test_bad_itl_targets_say_what_is_expected(text, says):
    with pytest.raises(ValueError, match=says):
        parse_itl_target(text)


def test_step_times_count_per_kind_into_buckets():
    times = StepTimes()
    times.observe("decode", 0.004)
    times.observe("mixed", 0.06)
    times.observe("mixed", 100.0)
    snap = times.snapshot()
    bounds, counts, total = snap["mixed"]
    assert sum(counts) == 2 and counts[-1] == 1 and total == pytest.approx(100.06)
    assert sum(snap["decode"][1]) == 1 and sum(snap["prefill"][1]) == 0


# -- the scheduler under the cap, with steps timed by the truth above -------------------------------


def _request(i: int, prompt_len: int, max_new: int) -> Request:
    return Request(f"r{i}", [5] * prompt_len, SamplingParams(max_new_tokens=max_new), seed=0, seq_id=i)


def _run(scheduler: Scheduler, model: StepCostModel, target_factor: float, steps: int, arrive):
    """Step the scheduler `steps` times with the ITL-target cap, timing each step by the truth
    and teaching the model; `arrive(step)` returns new requests. Returns (shape, seconds) per step."""
    history = []

    def cap(decodes, context, start, drafts=0, left=0):
        target = target_factor * model.decode_step_s(decodes, context)
        return model.prompt_tokens_within(target, decodes, context, start, drafts)

    for step in range(steps):
        for r in arrive(step):
            scheduler.add(r)
        out = scheduler.schedule(prefill_cap=cap)
        prompts = [c for c in out.chunks if c.num_tokens > 1]
        decodes = [c for c in out.chunks if c.num_tokens == 1]
        shape = StepShape(
            sum(c.num_tokens for c in prompts),
            sum(chunk_pairs(c.start, c.num_tokens) for c in prompts),
            len(decodes),
            sum(c.start + 1 for c in decodes),
        )
        seconds = true_seconds(shape)
        if out.chunks:
            model.observe(shape, seconds)
        history.append((shape, seconds))
        for c in out.chunks:
            if c.sample:
                if not c.request.output_token_ids:
                    c.request.first_token_step = step
                c.request.output_token_ids.append(7)
                scheduler.on_sampled(c.request)
                if len(c.request.output_token_ids) >= c.request.params.max_new_tokens:
                    scheduler.finish(c.request, "length")
    return history


def test_steps_beside_decodes_keep_the_target_once_learned():
    s = Scheduler(SchedulerConfig(num_blocks=4000, block_size=16, max_batched_tokens=2048))
    model = StepCostModel()
    chats = [_request(i, 32, 400) for i in range(8)]
    longs = {20 + 5 * k: _request(100 + k, 1500, 4) for k in range(10)}
    history = _run(
        s, model, 2.0, 120, lambda step: (chats if step == 0 else []) + ([longs[step]] if step in longs else [])
    )
    mixed = [(shape, sec) for shape, sec in history[30:] if shape.kind == "mixed"]
    assert mixed, "long prompts arrived amid running decodes"
    for shape, sec in mixed:
        decode_only = true_seconds(StepShape(decodes=shape.decodes, decode_context=shape.decode_context))
        assert sec <= 2.0 * decode_only * 1.05 or shape.prompt_tokens == MIN_CHUNK, (shape, sec, decode_only)
    # with no decodes running a prompt takes the whole budget
    s2 = Scheduler(SchedulerConfig(num_blocks=4000, block_size=16, max_batched_tokens=512))
    first = _run(s2, model, 2.0, 1, lambda step: [_request(0, 1500, 4)])
    assert first[0][0].prompt_tokens == 512


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones():
    s = Scheduler(SchedulerConfig(num_blocks=8000, block_size=16, max_batched_tokens=256))
    model = StepCostModel()
    model.observe(StepShape(decodes=4, decode_context=400), 0.01)
    model.observe(StepShape(prompt_tokens=256), 0.5)  # a prompt token looks dear: the cap is MIN_CHUNK
    chats = [_request(i, 16, 100_000) for i in range(4)]
    long = _request(999, 2000, 1)
    shorts = iter(_request(1000 + i, 24, 2) for i in range(10_000))
    history = _run(
        s, model, 1.5, 400, lambda step: (chats if step == 0 else []) + ([long] if step == 3 else []) + [next(shorts)]
    )
    assert long.output_token_ids, "the long prompt got its first token"
    assert all(shape.prompt_tokens >= MIN_CHUNK or shape.kind == "decode" for shape, _ in history[4:200])
    # it advanced by at least MIN_CHUNK every step once admitted: its first token within 2000 / 16
    # steps of its arrival, and a few for the shorts that arrived before it
    assert long.first_token_step - 3 <= 2000 // MIN_CHUNK + 8, long.first_token_step


def test_auto_is_twice_the_decode_step_but_never_below_the_floor():
    from dist_infer.engine.step_cost import AUTO_FLOOR_S
    from dist_infer.engine.step_pacing import StepPacer

    model = _fitted()
    small = true_seconds(StepShape(decodes=4, decode_context=400))  # ~5 ms: under the floor when doubled
    big = true_seconds(StepShape(decodes=400, decode_context=400_000))  # ~144 ms: doubled, above it
    assert AUTO_FACTOR * small < AUTO_FLOOR_S < AUTO_FACTOR * big
    for pp, itl, decodes, context, want in [
        (1, "auto", 4, 400, AUTO_FLOOR_S),
        (1, "auto", 400, 400_000, AUTO_FACTOR * big),
        (2, "auto", 4, 400, AUTO_FLOOR_S / 2),
        (1, "2x", 4, 400, 2 * small),
        (2, "50", 4, 400, 0.025),
    ]:
        got = StepPacer(parse_itl_target(itl), pp, model).step_target_s(decodes, context)
        assert got == pytest.approx(want, rel=0.02), (pp, itl, decodes, got)


def _driver(model: StepCostModel, itl: tuple):
    """The driver's cap (StepPacer.prompt_tokens_within), without an engine."""
    from dist_infer.engine.step_pacing import StepPacer

    return StepPacer(itl, 1, model).prompt_tokens_within


def _serve(scheduler: Scheduler, model: StepCostModel, truth: np.ndarray, cap, arrivals: list, seconds: float):
    """Step on a simulated clock for `seconds`, each step timed by `truth` and taught to the model;
    `arrivals`: (time, request), sorted. Notes each request's admission and first token times."""
    clock, pending = 0.0, list(arrivals)
    while clock < seconds:
        while pending and pending[0][0] <= clock:
            scheduler.add(pending.pop(0)[1])
        out = scheduler.schedule(prefill_cap=cap)
        if not out.chunks:
            clock = pending[0][0] if pending else seconds
            continue
        prompts = [c for c in out.chunks if c.num_tokens > 1]
        for c in prompts:
            c.request.__dict__.setdefault("admitted_s", clock)
        shape = StepShape(
            sum(c.num_tokens for c in prompts),
            sum(chunk_pairs(c.start, c.num_tokens) for c in prompts),
            len(out.chunks) - len(prompts),
            sum(c.start + 1 for c in out.chunks if c.num_tokens == 1),
        )
        seconds_taken = float(truth @ shape.features())
        clock += seconds_taken
        model.observe(shape, seconds_taken)
        for c in out.chunks:
            if c.sample:
                r = c.request
                r.__dict__.setdefault("first_token_s", clock)
                r.output_token_ids.append(7)
                scheduler.on_sampled(r)
                if len(r.output_token_ids) >= r.params.max_new_tokens:
                    scheduler.finish(r, "length")


# costs of the shape a small CPU shows (docs/benchmarks.md, "The floor: 200 ms"): per prompt token, per
# decode (the skinny kernels), fixed per step and more for a step with a prompt; made-up round values
CPU = np.array([9e-3, 5e-3, 1.6e-3, 2e-5, 2.7e-3, 5e-5, 1.7e-3, 3e-3])


def test_the_floor_keeps_a_chunked_prompts_wait_near_its_whole_step():
    """The floor's reason: on CPU costs a 256-token prompt beside 8 decodes gets its first token
    within 1.3x the step that would have run it whole beside them. Under a 100 ms target (the old
    floor) it was cut into slivers that each paid the decodes and fixed cost again."""

    def prompt_time(itl):
        s = Scheduler(SchedulerConfig(num_blocks=4000, block_size=16, max_batched_tokens=256, max_num_seqs=64))
        model = _fitted(CPU)
        prompt = _request(999, 256, 1)
        _serve(
            s,
            model,
            CPU,
            _driver(model, itl),
            [(0.0, _request(i, 32, 10_000)) for i in range(8)] + [(1.0, prompt)],
            5.0,
        )
        whole = float(CPU @ StepShape(256, chunk_pairs(0, 256), 8, 8 * 100).features())
        return (prompt.first_token_s - prompt.admitted_s) / whole

    assert prompt_time(parse_itl_target("auto")) <= 1.3
    assert prompt_time(parse_itl_target("100")) > 1.3


def test_a_prompt_a_little_past_the_target_finishes_in_its_step():
    """A prompt whose rest fits in FINISH_OVERRUN more than the target runs whole, its first token
    a step sooner (what vLLM does with a 256-token prompt beside decodes); a longer one is cut at the
    target as before. On the CPU costs, beside 8 decodes under auto (the 200 ms floor)."""
    from dist_infer.engine.step_pacing import FINISH_OVERRUN

    model = _fitted(CPU)
    cap = _driver(model, parse_itl_target("auto"))
    at_target = cap(8, 800, 0)
    assert cap(8, 800, 0, 0, at_target) == at_target
    step = lambda n: float(CPU @ StepShape(n, chunk_pairs(0, n), 8, 800).features())  # noqa: E731
    nearly = at_target + 20
    assert step(nearly) <= AUTO_FLOOR_S * (1 + FINISH_OVERRUN) < step(2 * at_target)
    assert cap(8, 800, 0, 0, nearly) == nearly
    assert cap(8, 800, 0, 0, 2 * at_target) == at_target

    s = Scheduler(SchedulerConfig(num_blocks=4000, block_size=16, max_batched_tokens=2048, max_num_seqs=64))
    prompt = _request(999, nearly, 1)
    chats = [(0.0, _request(i, 32, 10_000)) for i in range(8)]
    _serve(s, model, CPU, cap, chats + [(1.0, prompt)], 3.0)
    assert prompt.first_token_s - prompt.admitted_s == pytest.approx(step(nearly), rel=0.2)


def test_pipeline_steps_are_timed_by_their_slot():
    """pp=2: a step that ran alone took both stages (its time is halved); one that followed a step
    still in flight is timed from that step's completion (the pipeline's slot)."""
    from types import SimpleNamespace

    from dist_infer.engine.step_pacing import StepPacer

    chunks = [SimpleNamespace(num_tokens=1, start=10, sample=True, draft=[])]
    pacer = StepPacer(None, 2)
    pacer.learn(chunks, launched=1.0, now=1.2)  # alone: 0.2 s over 2 stages
    pacer.learn(chunks, launched=1.1, now=1.25)  # behind it: its slot, 0.05 s
    _, counts, total = pacer.step_times.snapshot()["decode"]
    assert sum(counts) == 2 and total == pytest.approx(0.1 + 0.05)
    assert pacer.step_costs.seen["decode"] == 2


@pytest.mark.parametrize(
    "argv,want",
    [
        (["--itl-target-ms", "50"], "50"),
        (["--decode-stall-limit", "2"], "2.0x"),
        (["--decode-stall-limit", "0"], "off"),
        ([], "auto"),
    ],
)
def test_the_serve_flags_give_the_engine_its_target(argv, want):
    import argparse

    from dist_infer.launch.model_options import add_scheduler_flags, itl_target

    p = argparse.ArgumentParser()
    add_scheduler_flags(p, offline=False)
    assert itl_target(p.parse_args(argv)) == want


@pytest.mark.parametrize(
    "argv",
    [
        ["--itl-target-ms", "fast"],
        ["--itl-target-ms", "1x"],
        ["--decode-stall-limit", "0.5"],
        ["--decode-stall-limit", "nan"],
        ["--decode-stall-limit", "x"],
    ],
)
def test_bad_targets_are_refused_when_the_flags_are_read(argv, capsys):
    import argparse

    from dist_infer.launch.model_options import add_scheduler_flags

    p = argparse.ArgumentParser()
    add_scheduler_flags(p, offline=False)
    with pytest.raises(SystemExit):
        p.parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_the_prefill_backlog_is_the_learned_cost_of_the_prompt_tokens_left():
    """The autoscaler's predicted wait: per prompt, a x tokens left + c x their attention pairs (from
    where it stands); unknown until a prompt's cost was learned, and nothing for a queue of none."""
    model = StepCostModel()
    assert prefill_backlog_s(model, [(0, 500)]) is None
    rng = random.Random(1)
    for _ in range(200):
        shape = _random_shape(rng)
        model.observe(shape, true_seconds(shape))
    _, _, a, c, _, _, _, _ = TRUE
    want = a * 500 + c * chunk_pairs(0, 500) / 1000 + a * 300 + c * chunk_pairs(200, 300) / 1000
    assert prefill_backlog_s(model, [(0, 500), (200, 300)]) == pytest.approx(want, rel=0.03)
    assert prefill_backlog_s(model, []) == 0.0


def test_the_engine_reports_its_prefill_backlog():
    """stats()['prefill_backlog_s'] counts the prompts waiting or part-way through, not the decodes."""
    from dist_infer.engine.step_pacing import StepPacer

    model = StepCostModel()
    model.observe(StepShape(decodes=1, decode_context=10), 0.01)
    model.observe(StepShape(prompt_tokens=100), 0.1)  # a prompt token: ~1 ms (one prompt size: no prompt_step yet)
    waiting, part, decoding = _request(0, 400, 4), _request(1, 300, 4), _request(2, 50, 4)
    part.num_computed, decoding.num_computed = 100, 49
    got = StepPacer(None, 1, model).prefill_backlog_s([waiting], [part, decoding])
    assert got == pytest.approx(prefill_backlog_s(model, [(0, 400), (100, 200)]))
    assert 0.4 < got < 0.8


def test_a_step_with_a_prompt_pays_a_fixed_cost_of_its_own():
    """Decode-only steps run their layers in one native call, steps with a prompt layer by layer
    (models/fused_decode.py): the fit keeps the two fixed costs apart, so a mixed step's chunk
    leaves room for the extra one and a decode step is not charged it."""
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(300):
        shape = _random_shape(rng)
        model.observe(shape, true_seconds(shape))
    fixed, prompt_step = model.coefficients()[:2]
    assert fixed == pytest.approx(TRUE[0], rel=0.02) and prompt_step == pytest.approx(TRUE[1], rel=0.02)
    assert model.decode_step_s(8, 4000) == pytest.approx(
        true_seconds(StepShape(decodes=8, decode_context=4000)), rel=0.01
    )
    n = model.prompt_tokens_within(0.05, 8, 4000, 0)
    assert (
        true_seconds(StepShape(prompt_tokens=n, prompt_pairs=chunk_pairs(0, n), decodes=8, decode_context=4000))
        <= 0.05 * 1.01
    )


def test_beside_decodes_the_backlog_is_paced_by_the_itl_target():
    """With decodes running under an ITL target, prompts advance one capped chunk per step of the
    target's length: the backlog is that many steps (when longer than the compute alone)."""
    from dist_infer.engine.step_pacing import StepPacer

    model = StepCostModel()
    model.observe(StepShape(decodes=1, decode_context=10), 0.01)
    model.observe(StepShape(prompt_tokens=100), 0.1)
    waiting, decoding = _request(0, 600, 4), _request(1, 50, 4)
    decoding.num_computed = 49
    seen = []

    def within(decodes, context, start):
        seen.append((decodes, context, start))
        return 64

    pacer = StepPacer(("auto", 2.0), 1, model)
    pacer.prompt_tokens_within = within
    pacer.step_target_s = lambda decodes, context: 0.1
    assert pacer.prefill_backlog_s([waiting], [decoding]) == pytest.approx(10 * 0.1)  # ceil(600 / 64) steps
    assert seen == [(1, 50, 0)]
    off = StepPacer(None, 1, model)  # the target off: the compute alone
    assert off.prefill_backlog_s([waiting], [decoding]) == pytest.approx(prefill_backlog_s(model, [(0, 600)]))


def test_proposals_verified_beside_the_decodes_leave_less_room_for_a_prompt():
    """A speculating decode's proposed rows cost the step time (draft_token, and draft_step once a
    step), so a chunk sized to the target beside them is smaller; both prices as shares of a token."""
    model = _fitted(seed=3)
    g, h = model.draft_costs_s()
    assert g == pytest.approx(TRUE[FEATURES.index("draft_token")], rel=0.05)
    assert h == pytest.approx(TRUE[FEATURES.index("draft_step")], rel=0.05)
    plain = model.prompt_tokens_within(0.05, 8, 800, 0)
    verifying = model.prompt_tokens_within(0.05, 8, 800, 0, draft_tokens=24)
    assert MIN_CHUNK < verifying < plain
    from dist_infer.engine.step_pacing import StepPacer

    pacer = StepPacer(("auto", 2.0), 1, model)
    per_token = model.decode_step_s(8, 800) / 8
    assert pacer.draft_prices(8, 800) == pytest.approx((g / per_token, h / per_token))

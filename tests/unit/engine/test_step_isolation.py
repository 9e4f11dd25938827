"""A request can fail only itself: an exception while running a step ends the
requests it belongs to with an error naming them (and an error id: the exception's text and
traceback go only to the log, under that id), the rest of the batch gets exactly the tokens
it gets alone, KV blocks are all returned, and the engine serves on. Failures are injected by
monkeypatching (the sampler, the forward, a stop check) on the tiny llama, one rank and tp=2 on
threads. (pp=2 in real processes: tests/integration/test_step_isolation_pp.py.)"""

from __future__ import annotations

import re

import pytest
import torch
from loguru import logger

import dist_infer.engine.stage_runner as stage_runner
from dist_infer.engine.engine_core import Engine, EngineConfig
from dist_infer.engine.request import RequestOutput
from dist_infer.engine.sampling import RowSampling, SamplingParams, sample_rows
from dist_infer.engine.step_guard import (
    MAX_FORWARD_FAILURES,
    ForwardFailures,
    StepGuard,
    failed_error_id,
    failed_token,
    sample_guarded,
)
from dist_infer.serving.fleet.wire import ResumeProgress
from tests.support.checkpoints import load_hf_model, write_hf_checkpoint
from tests.support.hf_compare import prompts_for
from tests.support.threads import run_ranks, thread_groups

NEW = 6
BLOCKS = 32
MARKER = 424242  # the seed of the request whose sampling raises
BOOM = "probability tensor contains either inf, nan or element < 0"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_hf_model(write_hf_checkpoint(tmp_path_factory.mktemp("isolation"), "llama-gqa"))


def _engine(model, groups, **kw):
    from dist_infer.models.loader import stage_from_hf_model

    return Engine(stage_from_hf_model(model, groups), groups, EngineConfig(block_size=4, num_blocks=BLOCKS, **kw))


def _params(seed: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, stop_at_eos=False, seed=seed)


PROMPTS = prompts_for([5, 9, 7, 4, 11], seed=30)


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt's greedy tokens, run alone on a fresh engine."""
    (groups,) = thread_groups(1, 1)
    out = []
    for p in PROMPTS:
        engine = _engine(model, groups)
        r = engine.add_request("alone", p, _params())
        while engine.has_unfinished():
            engine.step()
        out.append(r.output_token_ids)
    return out


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]], budget_steps: int = 500) -> dict:
    """Add the requests, step until idle; every output each request got, by id."""
    got: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    for _ in range(budget_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            got[out.request_id].append(out)
    assert not engine.has_unfinished()
    return got


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture
def logs():
    """Each error-level log record (message and traceback) while the test runs."""
    lines: list[str] = []
    logger.enable("dist_infer")
    sink = logger.add(lines.append, level="ERROR", format="{message}\n{exception}")
    yield lines
    logger.remove(sink)
    logger.disable("dist_infer")


def _assert_failed(
    outs: list[RequestOutput], rid: str, where: str, logs: list[str], exc_type: str, exc_text: str
) -> str:
    """`rid` ended with a 500 that names it, `where` and an error id, and nothing of the exception;
    the log has the exception (text and traceback) under that id. Returns the id."""
    last = outs[-1]
    assert last.finished and last.finish_reason == "abort" and last.error_status == 500, last
    shape = (
        rf"request {re.escape(rid)} failed in {re.escape(where)} \(error id (err-[0-9a-f]{{12}}); "
        r"the instance's log has the details\)"
    )
    found = re.fullmatch(shape, last.error or "")
    assert found, last.error
    assert exc_type not in last.error and exc_text not in last.error, "the exception stays in the log"
    error_id = found.group(1)
    logged = [line for line in logs if error_id in line and exc_text in line]
    assert any("Traceback" in line and exc_type in line for line in logged), (error_id, logs)
    assert sum(o.finished for o in outs) == 1
    return error_id


def _assert_idle_and_conserved(engine) -> None:
    s = engine.scheduler
    assert s.allocator.num_free == s.config.num_blocks == BLOCKS, "KV blocks conserved"
    assert not s.running and not s.waiting and not len(engine.registry)
    assert engine.stats()["free_blocks"] == BLOCKS


def _sampler(fail_row):
    """The real sampler, raising (as torch.multinomial does on bad probabilities) when any row
    is one `fail_row(row)` picks."""

    def sample(logits, rows, eos_ids=()):
        if any(fail_row(r) for r in rows):
            raise RuntimeError(BOOM)
        return sample_rows(logits, rows, eos_ids)

    return sample


def test_one_request_failing_in_sampling_fails_alone(model, alone, monkeypatch, logs):
    # the marked request raises from its third token on: it has blocks and tokens when it fails
    monkeypatch.setattr(stage_runner, "sample_rows", _sampler(lambda r: r.seed == MARKER and r.index >= 2))
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups, max_batched_tokens=8)  # prompts chunked: the failure meets mixed steps
    got = _run(
        engine, {"a": (PROMPTS[0], _params()), "bad": (PROMPTS[1], _params(MARKER)), "c": (PROMPTS[2], _params())}
    )
    _assert_failed(got["bad"], "bad", "sampling", logs, "RuntimeError", BOOM)
    assert _tokens(got["bad"]) == alone[1][:2], "what it had before the failure is what it got alone"
    for rid, i in (("a", 0), ("c", 2)):
        assert got[rid][-1].finish_reason == "length" and got[rid][-1].error is None
        assert _tokens(got[rid]) == alone[i], f"{rid}: the same tokens as alone"
    _assert_idle_and_conserved(engine)
    assert engine.guard.failed_requests == 1
    # the engine serves on, exactly
    got = _run(engine, {"d": (PROMPTS[3], _params()), "e": (PROMPTS[4], _params())})
    assert [_tokens(got["d"]), _tokens(got["e"])] == [alone[3], alone[4]]
    _assert_idle_and_conserved(engine)


def test_a_step_whose_sampling_fails_for_every_row_fails_its_requests(model, alone, monkeypatch, logs):
    armed = {"on": True}
    monkeypatch.setattr(stage_runner, "sample_rows", _sampler(lambda r: armed["on"] and r.index == 1))
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    got = _run(engine, {f"r{i}": (PROMPTS[i], _params()) for i in range(3)})
    ids = [_assert_failed(got[f"r{i}"], f"r{i}", "sampling", logs, "RuntimeError", BOOM) for i in range(3)]
    assert len(set(ids)) == 3, "each row's exception is its own, under its own id"
    for i in range(3):
        assert _tokens(got[f"r{i}"]) == alone[i][:1]
    _assert_idle_and_conserved(engine)
    armed["on"] = False
    got = _run(engine, {"later": (PROMPTS[3], _params())})
    assert _tokens(got["later"]) == alone[3] and got["later"][-1].finish_reason == "length"
    _assert_idle_and_conserved(engine)


def test_a_failing_stop_check_fails_only_its_request(model, alone, monkeypatch, logs):
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    real = engine.progress.stop_reason

    def stop_reason(r):
        if r.request_id == "bad" and len(r.output_token_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(r)

    monkeypatch.setattr(engine.progress, "stop_reason", stop_reason)
    got = _run(engine, {"a": (PROMPTS[0], _params()), "bad": (PROMPTS[1], _params())})
    _assert_failed(got["bad"], "bad", "taking its token", logs, "UnicodeDecodeError", "invalid start byte")
    assert _tokens(got["bad"]) == alone[1][:2], "the token whose check failed is not reported"
    assert _tokens(got["a"]) == alone[0]
    _assert_idle_and_conserved(engine)


def test_a_resumed_request_with_a_bad_token_fails_at_planning(model, alone, logs):
    # a resume's tokens come from the API; one outside the vocabulary would raise in every rank's embedding
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    progress = ResumeProgress(token_ids=[10**6], logprobs=[0.0], top_logprobs=[[]], age_s=0.0)
    engine.resume_request("resumed", PROMPTS[1], _params(), progress)
    engine.add_request("a", PROMPTS[0], _params())
    got: dict[str, list] = {"resumed": [], "a": []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out)
    _assert_failed(got["resumed"], "resumed", "planning its step", logs, "ValueError", "outside the vocabulary")
    assert _tokens(got["a"]) == alone[0]
    _assert_idle_and_conserved(engine)


def test_a_stop_token_id_among_the_most_allowed_still_ends_the_request(model, alone):
    # the step loop checks each token against the set SamplingParams made once, not the tuple
    from dist_infer.engine.sampling import MAX_STOP_TOKEN_IDS

    want = alone[0]
    k = max(k for k in range(len(want)) if want[k] not in want[:k])  # the last token not seen before it
    others = [10**6 + i for i in range(MAX_STOP_TOKEN_IDS - 1)]  # never sampled
    params = SamplingParams(max_new_tokens=NEW, stop_at_eos=False, seed=0, stop_token_ids=others + [want[k]])
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    got = _run(engine, {"s": (PROMPTS[0], params)})["s"]
    assert _tokens(got) == want[: k + 1], "the stop id is kept in the output"
    assert (got[-1].finish_reason, got[-1].stop_reason) == ("stop", want[k])
    _assert_idle_and_conserved(engine)


def test_a_plan_the_metadata_check_rejects_never_leaves_the_driver(model, alone, monkeypatch, logs):
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    real, calls = engine.worker.prepare, {"n": 0}

    def prepare(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("inconsistent plan")
        return real(plan)

    monkeypatch.setattr(engine.worker, "prepare", prepare)
    got = _run(engine, {"r0": (PROMPTS[0], _params()), "r1": (PROMPTS[1], _params())})
    ids = {
        _assert_failed(got[rid], rid, "checking its step", logs, "ValueError", "inconsistent plan")
        for rid in ("r0", "r1")
    }
    assert len(ids) == 1, "one exception, logged once, under one id both quote"
    _assert_idle_and_conserved(engine)
    got = _run(engine, {"later": (PROMPTS[2], _params())})
    assert _tokens(got["later"]) == alone[2]


def test_one_rank_serves_on_after_a_forward_failure_but_not_after_many(model, alone, monkeypatch, logs):
    (groups,) = thread_groups(1, 1)
    engine = _engine(model, groups)
    real, failing = engine.worker.execute, {"steps": 1}

    def execute(plan, inputs, meta=None):
        if failing["steps"] > 0:
            failing["steps"] -= 1
            raise RuntimeError("kernel failed")
        return real(plan, inputs, meta)

    monkeypatch.setattr(engine.worker, "execute", execute)
    got = _run(engine, {"r0": (PROMPTS[0], _params()), "r1": (PROMPTS[1], _params())})
    for rid in ("r0", "r1"):
        _assert_failed(got[rid], rid, "its step's forward", logs, "RuntimeError", "kernel failed")
    _assert_idle_and_conserved(engine)
    got = _run(engine, {"later": (PROMPTS[2], _params())})
    assert _tokens(got["later"]) == alone[2]
    # a forward that keeps failing is the instance's fault, not a request's: it ends the instance
    failing["steps"] = MAX_FORWARD_FAILURES
    for i in range(MAX_FORWARD_FAILURES - 1):
        _assert_failed(
            _run(engine, {f"x{i}": (PROMPTS[i], _params())})[f"x{i}"],
            f"x{i}",
            "its step's forward",
            logs,
            "RuntimeError",
            "kernel failed",
        )
    with pytest.raises(ForwardFailures, match=f"{MAX_FORWARD_FAILURES} steps in a row.*kernel failed"):
        _run(engine, {"last": (PROMPTS[3], _params())})


def test_tp2_on_threads_a_sampling_failure_fails_alone(model, alone, monkeypatch, logs):
    monkeypatch.setattr(stage_runner, "sample_rows", _sampler(lambda r: r.seed == MARKER and r.index >= 1))

    def body(groups):
        engine = _engine(model, groups, max_batched_tokens=8)
        if groups.world.rank != 0:
            engine.follow()
            return None
        first = _run(
            engine, {"a": (PROMPTS[0], _params()), "bad": (PROMPTS[1], _params(MARKER)), "c": (PROMPTS[2], _params())}
        )
        _assert_idle_and_conserved(engine)
        later = _run(engine, {"d": (PROMPTS[3], _params())})
        _assert_idle_and_conserved(engine)
        engine.stop_followers()
        return first, later

    first, later = run_ranks(thread_groups(2, 1), body)[0]
    _assert_failed(first["bad"], "bad", "sampling", logs, "RuntimeError", BOOM)
    assert [_tokens(first["a"]), _tokens(first["c"]), _tokens(later["d"])] == [alone[0], alone[2], alone[3]]


def test_with_more_than_one_rank_a_forward_failure_ends_the_instance():
    # the other ranks may be waiting in a collective of that forward: the ranks no longer agree
    guard = StepGuard(lambda r, message: None)
    with pytest.raises(RuntimeError, match="collective broke"):
        guard.forward_failed(RuntimeError("collective broke"), world_size=2)


def test_row_by_row_retry_keeps_the_good_rows_and_their_top_logprobs(logs):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [RowSampling(logprobs=2), RowSampling(seed=MARKER), RowSampling(temperature=0.8, seed=5, logprobs=3)]
    want = sample_rows(logits, rows)
    got = sample_guarded(_sampler(lambda r: r.seed == MARKER), logits, rows, ())
    tokens = got.tokens.tolist()
    assert [tokens[0], tokens[2]] == [int(want.tokens[0]), int(want.tokens[2])] and tokens[1] < 0
    error_id = failed_error_id(tokens[1])
    assert any(error_id in line and BOOM in line and "Traceback" in line for line in logs), "logged where it failed"
    assert torch.allclose(got.logprobs[[0, 2]], want.logprobs[[0, 2]])
    assert got.top_ids.shape == (3, 3) and got.top_ids[[0, 2]].tolist() == want.top_ids[[0, 2]].tolist()


@pytest.mark.parametrize("error_id", ["err-000000000000", "err-0123456789ab", "err-ffffffffffff"])
def test_a_failed_rows_token_carries_its_error_id(error_id):
    # a pipeline's sampler rank sends only tokens back: the id the driver tells the client rides in one
    token = failed_token(error_id)
    assert token < 0 and failed_error_id(token) == error_id
    assert failed_error_id(int(torch.tensor([token], dtype=torch.long)[0])) == error_id, "survives an int64 tensor"
    assert failed_error_id(0) is None and failed_error_id(31999) is None

"""The request registry and command queue (engine/intake.py), without an engine: commands come out
in order, those queued while one is applied included; registering numbers sequences; a resumed
request carries what its client has; a request that can never fit is refused by name."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dist_infer.engine.intake import RequestRegistry, check_servable, new_request, resume
from dist_infer.engine.request import PromptError
from dist_infer.engine.sampling import SamplingParams


def test_commands_come_out_in_order_until_the_queue_is_empty():
    registry = RequestRegistry()
    a = registry.submit(new_request("a", [1, 2], SamplingParams(seed=3)))
    registry.abort("a")
    calls = []
    registry.call_soon(lambda: (calls.append("first"), registry.call_soon(lambda: calls.append("queued inside"))))
    assert registry.has_unfinished(), "queued commands are unfinished work"
    taken = []
    for kind, arg in registry.take_commands():
        taken.append(kind)
        if kind == "call":
            arg()
    assert taken == ["add", "abort", "call", "call"] and calls == ["first", "queued inside"]
    assert not registry.has_unfinished() and list(registry.take_commands()) == []
    assert a.seed == 3 and a.prompt_token_ids == [1, 2]


def test_registering_numbers_sequences_and_forgetting_ends_them():
    registry = RequestRegistry()
    first, second = new_request("x", [1], SamplingParams()), new_request("y", [2], SamplingParams())
    registry.register(first)
    registry.register(second)
    assert (first.seq_id, second.seq_id) == (0, 1)
    assert registry.find("y") is second and "x" in registry and len(registry) == 2 and registry.has_unfinished()
    registry.forget("x")
    registry.forget("x")  # idempotent
    assert registry.find("x") is None and len(registry) == 1
    registry.register(first)  # adopted again (a migration back): a new sequence id
    assert first.seq_id == 2
    registry.count_added()
    assert registry.requests_added == 1


def test_a_request_without_a_seed_draws_its_own():
    seeds = {new_request(f"r{i}", [1], SamplingParams(seed=None)).seed for i in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**52 for s in seeds)


def test_a_command_wakes_an_idle_loop():
    registry = RequestRegistry()
    woke = threading.Event()

    def idle():
        registry.wait(30.0)
        woke.set()

    thread = threading.Thread(target=idle)
    thread.start()
    registry.abort("nobody")
    thread.join(30.0)
    assert woke.is_set(), "the wait ended at the command, not at its timeout"


def test_a_resumed_request_goes_on_from_what_its_client_has():
    progress = SimpleNamespace(
        token_ids=[7, 8],
        logprobs=[-0.1, -0.2],
        top_logprobs=[[[7, -0.1]], [[8, -0.2]]],
        age_s=3.0,
        first_token_age_s=2.0,
    )
    r = resume(new_request("r", [1, 2, 3], SamplingParams(seed=5, logprobs=1)), progress, now=100.0)
    assert r.output_token_ids == [7, 8] and r.output_logprobs == [-0.1, -0.2] and r.emitted_tokens == 2
    assert r.output_top_logprobs == [[(7, -0.1)], [(8, -0.2)]]
    assert (r.arrival_time, r.first_token_time) == (97.0, 98.0)
    nothing_yet = SimpleNamespace(token_ids=[], logprobs=[], top_logprobs=[], age_s=1.0, first_token_age_s=None)
    assert resume(new_request("s", [1], SamplingParams()), nothing_yet, now=10.0).first_token_time is None


def test_a_request_the_cache_can_never_hold_is_refused_naming_max_tokens():
    params = SamplingParams(max_new_tokens=4)
    check_servable([1, 2], params, vocab_size=10, max_positions=64, scheduler=None)  # no cache yet: the model only
    full = SimpleNamespace(check_fits=lambda prompt, new: f"{prompt + new} tokens need more blocks than the cache has")
    with pytest.raises(PromptError, match="prompt: 6 tokens need more blocks") as refused:
        check_servable([1, 2], params, vocab_size=10, max_positions=64, scheduler=full)
    assert refused.value.field == "max_tokens"
    with pytest.raises(PromptError):
        check_servable([1, 99], params, vocab_size=10, max_positions=64, scheduler=None)

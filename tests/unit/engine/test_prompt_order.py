"""engine/prompt_order.py: which prompt takes a step's budget first (fcfs, shortest-prompt with a max wait),
its keys as pure functions and its effect on the scheduler's steps; an engine under it still gives HF's
tokens with its blocks conserved."""

from __future__ import annotations

import random
from collections import deque

import pytest

from dist_infer.engine.prompt_order import RECOVERY_STEP_ROWS, PromptOrder, check_policy, prompt_key, recovery_tails
from dist_infer.engine.request import Request
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.scheduler_config import SchedulerConfig
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.engine_streams import serve_stream
from tests.support.hf_compare import prompts_for, steps_agreeing_with_hf
from tests.support.threads import thread_groups


def _request(i: int, prompt_len: int, arrival: float = 0.0) -> Request:
    r = Request(f"r{i}", list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=4), seed=0, seq_id=i)
    r.arrival_time = arrival
    return r


def _steps(s: Scheduler, n: int) -> list[list[tuple[str, int]]]:
    """n steps of (request id, tokens) each, every sampled request given a token."""
    steps = []
    for _ in range(n):
        out = s.schedule()
        steps.append([(c.request.request_id, c.num_tokens) for c in out.chunks])
        for c in out.chunks:
            if c.sample:
                c.request.output_token_ids.append(7)
                s.on_sampled(c.request)
    return steps


def _scheduler(policy: str, now: list, budget: int = 10, max_wait_s: float = 2.0) -> Scheduler:
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4, max_batched_tokens=budget, policy=policy))
    s.prompt_order = PromptOrder(policy, max_wait_s, clock=lambda: now[0])
    return s


def test_keys_order_mid_stream_then_aged_by_arrival_then_fewest_tokens_left():
    short, long_, old = _request(0, 5, arrival=9.0), _request(1, 50, arrival=8.0), _request(2, 80, arrival=1.0)
    resumed = _request(3, 90, arrival=9.5)
    resumed.resumed = True
    preempted = _request(4, 70, arrival=9.6)
    preempted.num_preemptions = 1
    everyone = [short, long_, old, resumed, preempted]
    order = sorted(everyone, key=lambda r: prompt_key(r, "shortest-prompt", 10.0, 5.0))
    assert [r.request_id for r in order] == ["r3", "r4", "r2", "r0", "r1"]
    fcfs = sorted(everyone, key=lambda r: prompt_key(r, "fcfs", 10.0, 5.0))
    assert [r.request_id for r in fcfs] == ["r3", "r4", "r2", "r1", "r0"]
    long_.num_computed = 48  # tokens left, not the prompt's length
    assert prompt_key(long_, "shortest-prompt", 10.0, 5.0) < prompt_key(short, "shortest-prompt", 10.0, 5.0)


def test_start_step_sorts_the_queue_only_under_shortest_prompt():
    queue = deque([_request(0, 30), _request(1, 5), _request(2, 12)])
    assert PromptOrder("fcfs", clock=lambda: 0.0).start_step(queue) is None
    assert [r.request_id for r in queue] == ["r0", "r1", "r2"]
    head = PromptOrder("shortest-prompt", clock=lambda: 0.0).start_step(queue)
    assert [r.request_id for r in queue] == ["r1", "r2", "r0"] and head == (2, 5, 0.0)


@pytest.mark.parametrize("policy,wait", [("sideways", 1.0), ("fcfs", 0.0), ("shortest-prompt", -1.0)])
def test_a_bad_policy_or_wait_is_refused_by_name(policy, wait):
    with pytest.raises(ValueError, match="scheduling policy 'sideways'" if policy == "sideways" else "max wait"):
        check_policy(policy, wait)
    with pytest.raises(ValueError):
        SchedulerConfig(num_blocks=4, policy=policy, max_wait_s=wait)


def test_a_short_prompt_goes_before_a_long_one_in_chunks_under_shortest_prompt_only():
    for policy, want in [
        ("fcfs", [[("r0", 10)], [("r0", 10)], [("r0", 10)], [("r0", 10)], [("r0", 1), ("r1", 5)]]),
        ("shortest-prompt", [[("r0", 10)], [("r1", 5), ("r0", 5)], [("r1", 1), ("r0", 9)]]),
    ]:
        now = [0.0]
        s = _scheduler(policy, now)
        long_, short = _request(0, 40), _request(1, 5, arrival=0.5)
        s.add(long_)
        steps = _steps(s, 1)
        s.add(short)
        steps += _steps(s, len(want) - 1)
        assert steps == want, policy


def test_a_prompt_that_waited_past_the_max_wait_goes_first():
    now = [0.0]
    s = _scheduler("shortest-prompt", now, max_wait_s=1.0)
    long_, short = _request(0, 40, arrival=0.0), _request(1, 6, arrival=0.1)
    s.add(long_)
    s.add(short)
    assert _steps(s, 1) == [[("r1", 6), ("r0", 4)]]
    now[0] = 1.0  # r0 has waited its max: it goes before a new shorter one
    s.add(_request(2, 3, arrival=0.9))
    assert _steps(s, 1) == [[("r1", 1), ("r0", 9)]]


def test_waiting_prompts_before_and_after_a_deferred_running_one_in_key_order():
    now = [0.0]
    s = _scheduler("shortest-prompt", now, budget=30)
    mid = _request(0, 40)
    s.add(mid)
    assert _steps(s, 1) == [[("r0", 30)]]  # 10 left
    s.add(_request(1, 25, arrival=0.2))
    s.add(_request(2, 4, arrival=0.3))
    # r2 (4 left) before r0 (10 left) before r1 (25 left), the budget shared in that order
    assert _steps(s, 1) == [[("r2", 4), ("r0", 10), ("r1", 16)]]


def _failed_over(i: int, prompt_len: int, computed: int) -> Request:
    r = _request(i, prompt_len)
    r.resumed, r.num_computed = True, computed
    return r


def test_recovery_tails_take_the_fewest_tokens_first_and_share_a_step_up_to_the_row_limit():
    long_tail, short, tiny, other = (
        _failed_over(0, 40, 20),
        _failed_over(1, 8000, 7997),
        _failed_over(2, 30, 27),
        _request(3, 9),
    )
    in_flight = _failed_over(4, 10, 9)
    in_flight.in_flight = True
    carried, rows = recovery_tails([long_tail, short, other, tiny, in_flight])
    assert carried == {id(short): 0, id(tiny): 1} and rows == 6  # 3 + 3; the 20-token tail waits a step
    carried, rows = recovery_tails([long_tail])
    assert carried == {id(long_tail): 0} and rows == 20 > RECOVERY_STEP_ROWS, "the first goes whole"
    assert recovery_tails([other]) == ({}, 0)


@pytest.mark.parametrize("policy", ["fcfs", "shortest-prompt"])
def test_failed_over_tails_run_shortest_first_and_the_long_one_next_step_before_other_prompts(policy):
    now = [0.0]
    s = _scheduler(policy, now, budget=64)
    s.add(_request(9, 300))
    _steps(s, 1)  # a running prompt in chunks: 64 of 300
    long_tail, short = _failed_over(0, 40, 24), _failed_over(1, 12, 9)
    for r in (long_tail, short):
        s.install(r, [s.allocator.allocate() for _ in range(-(-r.num_computed // 4))], computed_here=True)
    steps = _steps(s, 2)
    assert steps[0] == [("r1", 3), ("r9", 61)], "the 3-token tail first, the 16-token one not yet"
    assert steps[1] == [("r1", 1), ("r0", 16), ("r9", 47)], "the 16-token tail the next step, before the prompt"


def test_a_step_of_prompts_alone_keeps_the_cap_only_where_streams_may_arrive_mid_step():
    """No decodes: a prompt takes the whole budget, unless `pace_alone` (the instance holds a buddy's
    mirrored blocks, whose streams may fail over here at any step): then the ITL cap holds too."""
    for pace_alone, want in [(False, 64), (True, 5)]:
        s = _scheduler("fcfs", [0.0], budget=64)
        s.add(_request(0, 300))
        out = s.schedule(prefill_cap=lambda *shape: 5, pace_alone=pace_alone)
        assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", want)]


NEW = 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("prompt-order"), "llama-gqa")
    return path, load_hf_model(path)


def test_shortest_prompt_first_with_chunks_and_preemption_gives_hfs_tokens(llama):
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    _, model = llama
    rng = random.Random(5)
    prompts = prompts_for([rng.choice([3, 4, 17, 23]) for _ in range(8)], seed=5)
    refs = [hf_reference(None, [p], NEW, model=model) for p in prompts]
    (groups,) = thread_groups(1, 1)
    config = EngineConfig(
        block_size=4, num_blocks=9, max_batched_tokens=7, max_num_seqs=4, scheduling_policy="shortest-prompt"
    )
    engine = Engine(stage_from_hf_model(model, groups), groups, config)
    reqs = serve_stream(
        engine, prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False), [0, 0, 1, 1, 2, 5, 6, 9]
    )
    for i, r in enumerate(reqs):
        (want,), (want_logits,) = refs[i]
        assert r.finish_reason == "length"
        steps_agreeing_with_hf(r.output_token_ids, want, want_logits, f"prompt {i}")
    assert engine.stats()["free_blocks"] == 9, "KV blocks conserved"
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for everyone"
    engine.stop_followers()

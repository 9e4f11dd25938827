"""Layered prefill (engine/layered_prefill.py, models/layered.py): the pure bookkeeping, the
scheduler's steps, the plan's wire format, and the engine on real small models (dense and MoE, one
rank, tp=2 and ep=2 on threads) with long prompts amid decodes, under preemption and abort, checked
against HF transformers generating each prompt alone: greedy ids identical, logits within fp32
tolerance (a near tie the only excuse, named)."""

from __future__ import annotations

import pytest
import torch

from dist_infer.engine.layered_prefill import LayeredPrefill, LayerProgress, group_bounds, group_charge
from dist_infer.engine.request import Request
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.scheduler_config import SchedulerConfig
from dist_infer.engine.step_plan import StepPlan, decode, encode
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.hf_compare import ATOL, RTOL, prompts_for, steps_agreeing_with_hf
from tests.support.threads import run_ranks, thread_groups

# -- the pure parts -------------------------------------------------------------------------------


@pytest.mark.parametrize("layers,groups", [(4, 1), (4, 2), (4, 3), (7, 3), (30, 4), (5, 5)])
def test_groups_cover_every_layer_once_in_order(layers, groups):
    bounds = [group_bounds(layers, groups, i) for i in range(groups)]
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - f for f, e in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_group_bounds_refuse_what_cannot_be():
    for args in ((4, 5, 0), (4, 2, 2), (4, 0, 0)):
        with pytest.raises(ValueError):
            group_bounds(*args)


def test_charge_and_group_count_follow_the_budget():
    assert group_charge(100, 0, 3, 12) == 25 and group_charge(1, 0, 1, 30) == 1
    auto = LayeredPrefill(num_layers=6)
    assert auto.groups_for(40, 16) == 3, "ceil(40 / 16)"
    assert auto.groups_for(400, 16) == 6, "at most one group per layer"
    assert LayeredPrefill(num_layers=6, groups=4).groups_for(40, 16) == 4
    assert LayeredPrefill(num_layers=2, groups=4).groups_for(40, 16) == 2
    with pytest.raises(ValueError, match="layer-groups"):
        LayeredPrefill(num_layers=6, groups=0)


def test_step_plan_carries_the_layered_sequence():
    plan = StepPlan(
        seq_ids=[3, 9],
        num_tokens=[1, 5],
        starts=[7, 0],
        block_tables=[[0, 1], [2, 3]],
        sample=[True, False],
        input_ids=[1, 2, 3, 4, 5, 6],
        layered=[(1, 2, 4)],
    )
    back = decode(*encode(plan))
    assert back.layered == [(1, 2, 4)] and back.seq_ids == [3, 9] and back.input_ids == plan.input_ids
    assert (
        decode(
            *encode(StepPlan(seq_ids=[1], num_tokens=[1], starts=[0], block_tables=[[0]], sample=[True], input_ids=[5]))
        ).layered
        == []
    )


# -- the scheduler --------------------------------------------------------------------------------


def _request(i: int, prompt_len: int, max_new: int = 4) -> Request:
    return Request(f"r{i}", list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=max_new), seed=0, seq_id=i)


def _layered_scheduler(num_blocks=100, budget=10, layers=4, groups=None, **kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks, block_size=4, max_batched_tokens=budget, layered=LayeredPrefill(layers, groups), **kw
        )
    )


def _finish_step(scheduler, out, token=7):
    for chunk in out.chunks:
        if chunk.sample:
            chunk.request.output_token_ids.append(token)
            scheduler.on_sampled(chunk.request)


def test_a_long_prompt_runs_whole_group_by_group_beside_decodes():
    s = _layered_scheduler(budget=10, layers=4)
    a, b = _request(0, 3), _request(1, 25)
    s.add(a)
    _finish_step(s, s.schedule())
    s.add(b)
    seen = []
    for _ in range(3):
        out = s.schedule()
        seen.append(
            [(c.request.request_id, c.start, c.num_tokens, c.sample, c.layers, c.work_tokens) for c in out.chunks]
        )
        assert b.num_computed == (25 if out.chunks[-1].sample else 0), "computed only after its last group"
        _finish_step(s, out)
    # 25 tokens beside one decode: 9 tokens of room -> ceil(25 / 9) = 3 groups of 4 layers (2, 1, 1)
    assert seen == [
        [("r0", 3, 1, True, None, None), ("r1", 0, 25, False, (0, 2), 13)],
        [("r0", 4, 1, True, None, None), ("r1", 0, 25, False, (2, 3), 7)],
        [("r0", 5, 1, True, None, None), ("r1", 0, 25, True, (3, 4), 7)],
    ]
    assert len(b.block_table) == 7 and b.layer_progress is None
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens, c.layers) for c in out.chunks] == [("r0", 1, None), ("r1", 1, None)]


def test_a_prompt_within_the_budget_is_not_layered_and_one_prompt_is_in_its_layers_at_a_time():
    s = _layered_scheduler(budget=10, layers=4)
    for i, n in enumerate((6, 30, 20, 3)):
        s.add(_request(i, n))
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens, c.layers) for c in out.chunks] == [("r0", 6, None), ("r1", 30, (0, 1))]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"], "r2 waits for r1's layers (first come, first served)"


def test_preempting_or_aborting_a_prompt_mid_layers_frees_everything_and_starts_over():
    s = _layered_scheduler(num_blocks=12, budget=8, layers=4, watermark=0.0)
    a = _request(0, 30, max_new=2)
    s.add(a)
    out = s.schedule()
    assert out.chunks[0].layers == (0, 1) and len(a.block_table) == 8
    s.finish(a, "abort")
    assert s.num_free_blocks == 12 and a.layer_progress is None
    assert [r.request_id for r in s.schedule().freed] == ["r0"], "the ranks are told to drop its hidden states"
    b, c = _request(1, 20, max_new=9), _request(2, 13)
    s.add(b)
    _finish_step(s, s.schedule())  # b: 20 tokens in 3 groups; its first group ran
    s.add(c)
    s2 = s.schedule()
    assert b.layer_progress is not None and c in s.waiting
    _finish_step(s, s2)
    while b.layer_progress is not None:
        _finish_step(s, s.schedule())
    s._preempt(b, s.schedule())
    assert b.layer_progress is None and b.num_computed == 0 and b in s.waiting
    assert s.num_free_blocks + sum(len(r.block_table) for r in s.running) == 12, "blocks conserved"


def test_layered_needs_chunked_prefill_and_no_cp():
    with pytest.raises(ValueError, match="layered prefill"):
        SchedulerConfig(num_blocks=8, layered=LayeredPrefill(4), chunked_prefill=False)
    with pytest.raises(ValueError, match="layered prefill"):
        SchedulerConfig(num_blocks=8, layered=LayeredPrefill(4), whole_prompt_steps=True)
    assert LayerProgress(0, 10, 3, done=2).last


# -- the engine on real models --------------------------------------------------------------------

NEW = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("layered")
    out = {}
    for arch, kw in (("llama-gqa", dict(num_hidden_layers=4)), ("qwen2-moe", {})):
        path = write_hf_checkpoint(root, arch, **kw)
        out[arch] = load_hf_model(path)
    return out


def _serve(model, groups, prompts, arrivals, groups_flag=None, abort=None, **kw):
    """The engine over `model` with the layered schedule: prompt i arrives at step arrivals[i]; the
    request named `abort` is aborted the first step it is in its layers. Rank 0 returns the
    requests, the layer groups [first, end) its steps ran, and the free blocks at the end."""
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    engine = Engine(
        stage_from_hf_model(model, groups),
        groups,
        EngineConfig(block_size=4, prefill_schedule="layered", layer_groups=groups_flag, **kw),
    )
    if groups.world.rank != 0:
        engine.follow()
        return None
    engine.return_logits = True
    params = SamplingParams(max_new_tokens=NEW, stop_at_eos=False)
    pending, requests, ran, step = sorted(range(len(prompts)), key=lambda i: arrivals[i]), {}, [], 0
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs):
        mid_layers = [r for r in engine.scheduler.running if r.layer_progress is not None]
        out = schedule(*args, **kwargs)
        ran.extend(c.layers for c in out.chunks if c.layers is not None)
        ran.extend("preempted mid-layers" for r in out.preempted if r in mid_layers)
        return out

    engine.scheduler.schedule = recording
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            requests[i] = engine.add_request(f"q{i}", prompts[i], params)
        layered = [r for r in engine.scheduler.running if r.layer_progress is not None]
        if abort is not None and any(r.request_id == abort for r in layered):
            engine.abort(abort)
            abort = None
        engine.step()
        step += 1
        assert step < 500
    free = engine.stats()["free_blocks"]
    engine.stop_followers()
    assert not engine.worker._layered_hidden, "no hidden states left behind"
    return [requests[i] for i in range(len(prompts))], ran, free


def _assert_like_hf(model, prompts, reqs, what, skip=()):
    for i, (prompt, r) in enumerate(zip(prompts, reqs)):
        if i in skip:
            continue
        (want,), (want_logits,) = hf_reference(None, [prompt], NEW, model=model)
        steps = steps_agreeing_with_hf(r.output_token_ids, want, want_logits, f"{what} prompt {i}")
        got = torch.stack(r.logits[:steps])
        torch.testing.assert_close(got, want_logits[:steps], atol=ATOL, rtol=RTOL, msg=f"{what} prompt {i}")


@pytest.mark.parametrize(
    "arch,tp,ep",
    [("llama-gqa", 1, 1), ("qwen2-moe", 1, 1), ("llama-gqa", 2, 1), ("qwen2-moe", 2, 1), ("qwen2-moe", 1, 2)],
)
def test_long_prompts_amid_decodes_give_hfs_tokens_and_logits(models, arch, tp, ep):
    model = models[arch]
    prompts = prompts_for([5, 37, 3, 29, 41], seed=tp * 10 + ep)
    arrivals = [0, 2, 3, 4, 12]

    def body(groups):
        return _serve(model, groups, prompts, arrivals, num_blocks=64, max_batched_tokens=12)

    reqs, ran, free = run_ranks(thread_groups(tp, ep), body)[0]
    assert len(set(ran) - {"preempted mid-layers"}) > 1, "a prompt ran in layer groups"
    assert free == 64, "KV blocks conserved"
    _assert_like_hf(model, prompts, reqs, f"{arch} tp={tp} ep={ep}")


def test_fixed_groups_preemption_and_abort_mid_layers(models):
    model = models["llama-gqa"]
    prompts = prompts_for([10, 4, 20, 18], seed=7)
    (groups,) = thread_groups(1, 1)
    reqs, ran, free = _serve(
        model,
        groups,
        prompts,
        [0, 1, 1, 5],
        groups_flag=4,
        abort="q3",
        num_blocks=10,
        max_batched_tokens=10,
        watermark=0.0,
    )
    assert free == 10
    assert reqs[3].finish_reason == "abort"
    assert "preempted mid-layers" in ran, "the cache was meant to be too small: a prompt preempted in its layers"
    assert sorted(set(ran) - {"preempted mid-layers"}) == [(0, 1), (1, 2), (2, 3), (3, 4)], "four groups of one layer"
    _assert_like_hf(model, prompts, reqs, "groups=4, small cache", skip={3})


def test_layered_refuses_what_it_cannot_run(models):
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    (groups,) = thread_groups(1, 1)
    stage = stage_from_hf_model(models["llama-gqa"], groups, ladder="all")
    with pytest.raises(ValueError, match="Ladder Residual"):
        Engine(stage, groups, EngineConfig(prefill_schedule="layered"))
    with pytest.raises(ValueError, match="not one of"):
        Engine(stage_from_hf_model(models["llama-gqa"], groups), groups, EngineConfig(prefill_schedule="sideways"))


def test_layered_reads_each_experts_weights_once_per_prompt_where_chunks_read_them_per_chunk(models):
    """The point of the schedule on MoE models, counted (not timed): the routing statistics count an
    expert's weights read once per step that routes it any token."""
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import stage_from_hf_model

    model = models["qwen2-moe"]
    prompts = prompts_for([60, 3], seed=5)
    reads = {}
    for schedule in ("chunked", "layered"):
        (groups,) = thread_groups(1, 1)
        stage = stage_from_hf_model(model, groups)
        engine = Engine(
            stage, groups, EngineConfig(block_size=4, num_blocks=64, max_batched_tokens=12, prefill_schedule=schedule)
        )
        reqs = [
            engine.add_request(f"m{i}", p, SamplingParams(max_new_tokens=3, stop_at_eos=False))
            for i, p in enumerate(prompts)
        ]
        while engine.has_unfinished():
            engine.step()
        engine.stop_followers()
        reads[schedule] = sum(s.expert_reads["prompt"] for s in stage.routing_stats().values())
        assert all(r.finish_reason == "length" for r in reqs)
    sparse = sum(1 for layer in stage.layers if layer.sparse)
    # 60 + 3 tokens, 12 a step: chunked reads (nearly) every expert of every sparse layer in each of 6 steps
    assert reads["layered"] <= sparse * 8 + 8, reads
    assert reads["layered"] < 0.5 * reads["chunked"], reads


class _Instance:
    """What MigrationEndpoint reads of an engine: a (layered) scheduler, its requests, queued transfers."""

    def __init__(self):
        from types import SimpleNamespace

        self.scheduler = _layered_scheduler(budget=10, layers=4)
        self.block_size = 4
        self.mover = SimpleNamespace(stage_done=lambda mid, stage: True, failures=set())
        self.requests, self.ops = {}, []

    def find(self, request_id):
        return self.requests.get(request_id)

    def queue_transfer(self, op):
        self.ops.append(op)


def test_a_migration_pauses_a_prompt_in_its_layers_only_after_its_last_group():
    from dist_infer.engine.kv_transfer import PeerInstance
    from dist_infer.engine.migration import MigrationEndpoint

    src = _Instance()
    endpoint = MigrationEndpoint(src, lambda *event: None)
    r = src.requests["r0"] = _request(0, 25)
    src.scheduler.add(r)
    _finish_step(src.scheduler, src.scheduler.schedule())  # its first layer group
    assert r.layer_progress is not None
    started, paused = [], []
    endpoint.start_out(1, "r0", PeerInstance(1, 1, 1, (("127.0.0.1", 1001),)), reply=started.append)
    assert started[0]["hashes"] == [], "nothing computed yet: no block a destination could hold"
    endpoint.pause_out(1, 0, True, 0, reply=paused.append)
    groups = 1
    while not paused:
        assert r.layer_progress is not None or r.num_computed == 25, "paused only after its last group"
        _finish_step(src.scheduler, src.scheduler.schedule())
        groups += 1
        endpoint.poll()
        assert groups < 10
    state, first, count = paused[0]
    assert state.num_computed == 25 and (first, count) == (0, 7) and groups == 3, (state.num_computed, first, count)

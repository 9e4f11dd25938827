"""Ladder Residual (models/ladder.py) against a plain single-process reference of its forward.

The reference (tests/support/ladder_reference.py) is a few lines of torch over the HF model's own
weights and modules: the ladder wiring of arXiv 2501.06589, recomputing every prefix in full. Ours
runs in the engine (chunked prefills beside decodes, the KV cache) at tp=1, 2, 3 and 4 on threads,
and stage by stage for pp=2."""

from __future__ import annotations

import pytest
import torch

from dist_infer.arg_types import parse_ladder_residual
from dist_infer.comm.base import Handle
from dist_infer.engine.sampling import SamplingParams
from dist_infer.models.config import ModelConfig, ModelConfigError, ladder_from_json, with_ladder
from dist_infer.models.ladder import LadderError
from tests.support.checkpoints import load_hf_model, write_hf_checkpoint
from tests.support.hf_compare import ATOL, RTOL, prompts_for
from tests.support.ladder_reference import reference_greedy, reference_logits
from tests.support.threads import ThreadComm, run_ranks, thread_groups

NEW, BS = 4, 4
PROMPTS = prompts_for([5, 9, 3], seed=21)


# -- ours, in the engine ------------------------------------------------------------------------


def _serve(hf, groups, ladder, **worker_kw):
    from dist_infer.engine.engine_core import Engine, EngineConfig, WorkerOptions
    from dist_infer.models.loader import stage_from_hf_model

    config = EngineConfig(
        block_size=BS, num_blocks=24, max_batched_tokens=6, max_num_seqs=3, worker=WorkerOptions(**worker_kw)
    )
    engine = Engine(stage_from_hf_model(hf, groups, ladder=ladder), groups, config)
    if groups.world.rank != 0:
        engine.follow()
        return None
    engine.return_logits = True
    params = SamplingParams(max_new_tokens=NEW, stop_at_eos=False)
    reqs = [engine.add_request(f"q{i}", p, params) for i, p in enumerate(PROMPTS)]
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
    engine.stop_followers()
    return [(r.output_token_ids, torch.stack(r.logits)) for r in reqs]


class _LateHandle(Handle):
    def __init__(self, run):
        self.run = run

    def wait(self, timeout=None) -> None:
        if self.run is not None:
            self.run, run = None, self.run
            run()

    def is_completed(self) -> bool:
        return self.run is None


class LateReduceComm(ThreadComm):
    """A tp group whose asynchronous all-reduce happens only when it is waited for: a partial sum
    read before its wait is still this rank's own (so a missed wait shows in the logits)."""

    def all_reduce(self, tensor, op="sum", async_op=False):
        if not async_op or self.size == 1:
            return super().all_reduce(tensor, op, async_op)
        return _LateHandle(lambda: super(LateReduceComm, self).all_reduce(tensor, op))


def _ours(hf, tp: int, ladder, **worker_kw):
    groups = thread_groups(tp, 1)
    for g in groups:
        g.tp = LateReduceComm(g.tp.meeting, g.tp.rank, "tp")
    return run_ranks(groups, lambda g: _serve(hf, g, ladder, **worker_kw))[0]


def _assert_matches(got, hf, ladder, what: str) -> None:
    for i, (prompt, (ids, logits)) in enumerate(zip(PROMPTS, got)):
        want_ids, want_logits = reference_greedy(hf, prompt, ladder, NEW)
        assert ids == want_ids, f"{what}, prompt {i}: {ids} vs the reference's {want_ids}"
        torch.testing.assert_close(logits, want_logits, atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_hf_model(write_hf_checkpoint(tmp_path_factory.mktemp("ladder"), "llama-gqa", num_hidden_layers=4))


def test_the_reference_without_ladder_is_hfs_forward(llama):
    ids = PROMPTS[1]
    with torch.no_grad():
        want = llama(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(reference_logits(llama, ids), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_ladder_on_every_layer_matches_the_reference(llama, tp):
    _assert_matches(_ours(llama, tp, "all"), llama, (0, 3), f"tp={tp}, all layers")


def test_a_ladder_sub_range_matches_the_reference_and_differs_from_the_standard_model(llama):
    got = _ours(llama, 2, "1:2")
    _assert_matches(got, llama, (1, 2), "tp=2, layers 1:2")
    standard = _ours(llama, 2, "off")
    _assert_matches(standard, llama, None, "tp=2, no ladder")
    for (_, ladder_logits), (_, plain_logits) in zip(got, standard):
        assert (ladder_logits - plain_logits).abs().max() > 1e-2, "the ladder wiring changed nothing"
    assert (reference_logits(llama, PROMPTS[1], (0, 3)) - reference_logits(llama, PROMPTS[1])).abs().max() > 1e-2


def test_token_split_and_sequence_parallel_steps_run_the_ladder_unchanged(llama):
    got = _ours(
        llama, 2, "all", overlap="on", overlap_threshold=1, sequence_parallel="on", sequence_parallel_threshold=1
    )
    _assert_matches(got, llama, (0, 3), "tp=2, --overlap on, --sequence-parallel on")


def test_moe_ladder_matches_the_reference(tmp_path):
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "qwen2-moe"))  # 3 layers, layer 1 dense, a shared expert
    _assert_matches(_ours(hf, 2, "all"), hf, (0, 2), "qwen2-moe tp=2")


# -- pp: two stages, each handing the next what it needs ---------------------------------------


def _stage(hf, cfg, layers, first, last, kernels=None):
    from dist_infer.kernels import use_native_kernels
    from dist_infer.models.llama import LlamaStage

    (groups,) = thread_groups(1, 1)
    stage = LlamaStage(cfg, groups.tp, layers, first, last)
    state = hf.state_dict()
    stage.load_weights(lambda name: state[name])
    use_native_kernels(stage, kernels)
    return stage


@pytest.mark.parametrize("native", [False, True])  # True: the decode step through decode_layer_part (fused_decode.py)
@pytest.mark.parametrize("ladder,cut,width", [("all", 2, 2), ("1:2", 2, 2), ("0:1", 2, 1), ("2:3", 1, 1)])
def test_pp2_stages_are_the_one_stage_model(llama, ladder, cut, width, native):
    from dist_infer.engine.kv_cache import PagedKVCache
    from dist_infer.kernels import load_cpu_kernels
    from dist_infer.models.attention_metadata import build_attention_metadata

    kernels = load_cpu_kernels() if native else None
    if native and kernels is None:
        pytest.skip("no C compiler: the native kernels are not built")
    cfg = with_ladder(ModelConfig.from_hf(llama.config.to_dict()), ladder)
    stages = [
        _stage(llama, cfg, range(0, cut), True, False, kernels),
        _stage(llama, cfg, range(cut, 4), False, True, kernels),
    ]
    assert stages[1].input_width == width * cfg.hidden_size
    prompt = PROMPTS[1]
    want = reference_logits(llama, prompt + [7], cfg.ladder_layers)
    caches = [PagedKVCache(len(s.layers), 8, BS, s.kv_heads_local, cfg.head_dim).layers for s in stages]
    inputs = torch.tensor(prompt)
    for step, (q, s) in enumerate(((len(prompt), len(prompt)), (1, len(prompt) + 1))):
        meta = build_attention_metadata([q], [s], [[0, 1, 2]], BS)
        with torch.inference_mode():
            hidden = stages[0](inputs, meta, caches[0])
            assert hidden.shape == (q, width * cfg.hidden_size)
            logits = stages[1](hidden, meta, caches[1])
        torch.testing.assert_close(logits[0], want[s - 1], atol=ATOL, rtol=RTOL)
        inputs = torch.tensor([7])
    assert all((s.decode_stack_cache is not None and s.decode_stack_cache.plan is not None) == native for s in stages)


# -- selection ----------------------------------------------------------------------------------


def test_the_flag_parses_and_names_itself():
    assert parse_ladder_residual("all") == "all" and parse_ladder_residual(" OFF ") == "off"
    assert parse_ladder_residual("3:5") == (3, 5) and parse_ladder_residual(None) is None
    for bad in ("3", "5:3", "-1:2", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="--ladder-residual"):
            parse_ladder_residual(bad)


def test_config_json_and_the_override():
    assert ladder_from_json(None, 4, "c") is None and ladder_from_json(False, 4, "c") is None
    assert ladder_from_json(True, 4, "c") == ladder_from_json("all", 4, "c") == (0, 3)
    assert ladder_from_json(2, 4, "c") == (2, 3) and ladder_from_json([1, 2], 4, "c") == (1, 2)
    for bad in (4, [2, 1], [0, 4], "some", [1], 1.5):
        with pytest.raises(ModelConfigError, match="ladder_residual"):
            ladder_from_json(bad, 4, "c")
    hf = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        vocab_size=128,
        ladder_residual=[1, 3],
    )
    cfg = ModelConfig.from_hf(hf)
    assert cfg.ladder_layers == (1, 3)
    assert with_ladder(cfg, None).ladder_layers == (1, 3) and with_ladder(cfg, "off").ladder_layers is None
    assert with_ladder(cfg, "all").ladder_layers == (0, 3) and with_ladder(cfg, "0:1").ladder_layers == (0, 1)
    with pytest.raises(ModelConfigError, match="--ladder-residual 2:4"):
        with_ladder(cfg, "2:4")


def test_the_cli_flag_is_checked_when_parsed():
    import argparse

    from dist_infer.launch.model_options import add_model_flags

    p = argparse.ArgumentParser()
    add_model_flags(p)
    assert p.parse_args(["--ladder-residual", "2:3"]).ladder_residual == "2:3"
    assert p.parse_args([]).ladder_residual is None
    with pytest.raises(SystemExit):
        p.parse_args(["--ladder-residual", "3:2"])


def test_context_parallelism_is_refused():
    from dist_infer.models.ladder import LadderPlan

    cfg = ModelConfig.from_hf(
        dict(
            model_type="llama",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            vocab_size=128,
            ladder_residual=True,
        )
    )
    with pytest.raises(LadderError, match="--cp 2"):
        LadderPlan(cfg, range(4), cp_size=2)
    assert not LadderPlan(cfg, range(0), cp_size=2).active

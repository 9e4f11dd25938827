"""EngineConfig (engine/engine_config.py): the defaults the engine's keywords had, the checks that
refuse a bad setting by name when the config is made, and the scheduler config derived from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dist_infer.engine.engine_config import (
    DEFAULT_OVERLAP_THRESHOLD,
    DEFAULT_SEQUENCE_PARALLEL_THRESHOLD,
    HEARTBEAT_S,
    EngineConfig,
    WorkerOptions,
)
from dist_infer.engine.layered_prefill import LayeredPrefill
from dist_infer.models.cp_attention import ContextParallelError


def test_the_defaults_are_the_engines_keywords_defaults():
    """What `Engine(stage, groups)` ran with before the config existed, field by field."""
    assert dataclasses.asdict(EngineConfig()) == {
        "block_size": 16,
        "num_blocks": None,
        "max_batched_tokens": None,
        "max_num_seqs": 256,
        "chunked_prefill": True,
        "watermark": 0.01,
        "static_batching": False,
        "scheduling_policy": "fcfs",
        "prompt_max_wait_s": 2.0,
        "itl_target": None,
        "prefix_caching": False,
        "prefill_schedule": "chunked",
        "layer_groups": None,
        "heartbeat_s": HEARTBEAT_S,
        "worker": {
            "overlap": "off",
            "overlap_threshold": DEFAULT_OVERLAP_THRESHOLD,
            "sequence_parallel": "off",
            "sequence_parallel_threshold": DEFAULT_SEQUENCE_PARALLEL_THRESHOLD,
            "cp_variant": "auto",
            "cuda_graphs": "auto",
        },
        "speculative": None,
    }
    assert HEARTBEAT_S == 2.0 and EngineConfig().itl is None


@pytest.mark.parametrize(
    "fields,error,match",
    [
        ({"overlap": "sometimes"}, ValueError, "overlap mode must be on, off or auto, got 'sometimes'"),
        ({"sequence_parallel": "yes"}, ValueError, "sequence-parallel mode must be on, off or auto"),
        ({"cp_variant": "ring"}, ContextParallelError, "cp variant 'ring' is not one of"),
        ({"cuda_graphs": "always"}, ValueError, "--cuda-graphs 'always'"),
        ({"overlap_threshold": 0}, ValueError, r"overlap_threshold \(--overlap-threshold\) must be at least 1, got 0"),
        (
            {"sequence_parallel_threshold": -5},
            ValueError,
            r"sequence_parallel_threshold \(--sequence-parallel-threshold\)",
        ),
    ],
)
def test_a_bad_worker_option_is_refused_by_name(fields, error, match):
    with pytest.raises(error, match=match):
        WorkerOptions(**fields)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"block_size": 0}, "block_size must be at least 1, got 0"),
        ({"num_blocks": 0}, "num_blocks must be at least 1"),
        ({"max_batched_tokens": -1}, "max_batched_tokens must be at least 1"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1"),
        ({"layer_groups": 0}, "layer_groups must be at least 1"),
        ({"watermark": 1.0}, "watermark must be a fraction"),
        ({"watermark": -0.1}, "watermark must be a fraction"),
        ({"heartbeat_s": 0.0}, "heartbeat_s must be positive"),
        ({"heartbeat_s": float("nan")}, "heartbeat_s must be positive"),
        ({"prefill_schedule": "sideways"}, "prefill schedule 'sideways' is not one of"),
        ({"itl_target": "fast"}, "--itl-target 'fast'"),
        ({"itl_target": "1x"}, "must be above 1"),
    ],
)
def test_a_bad_setting_is_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**fields)


def test_worker_options_must_be_the_dataclass():
    with pytest.raises(TypeError, match="worker must be WorkerOptions, got dict"):
        EngineConfig(worker={"overlap": "on"})


def test_a_changed_copy_is_checked_again():
    """The engine switches a mode with dataclasses.replace: the new value goes through the checks."""
    config = EngineConfig(worker=WorkerOptions(overlap="auto"))
    assert dataclasses.replace(config.worker, overlap="on").overlap == "on"
    with pytest.raises(ValueError, match="overlap mode"):
        dataclasses.replace(config.worker, overlap="both")


def test_the_itl_target_parses_as_the_pacing_takes_it():
    assert EngineConfig(itl_target="auto").itl == ("auto", 2.0)
    assert EngineConfig(itl_target="3x").itl == ("x", 3.0)
    assert EngineConfig(itl_target="50").itl == ("ms", 50.0)
    assert EngineConfig(itl_target="off").itl is None


def test_the_scheduler_config_follows_the_settings():
    config = EngineConfig(
        block_size=4, max_batched_tokens=64, max_num_seqs=8, watermark=0.05, static_batching=True, prefix_caching=True
    )
    s = config.scheduler_config(100, 2048, cp=1, layered=None)
    assert (s.num_blocks, s.block_size, s.max_batched_tokens, s.max_num_seqs, s.watermark) == (100, 4, 64, 8, 0.05)
    assert s.chunked_prefill and not s.whole_prompt_steps and s.static_batching and s.prefix_caching
    layered = LayeredPrefill(num_layers=4)
    assert config.scheduler_config(100, 2048, cp=1, layered=layered).layered is layered


def test_unchunked_the_budget_grows_to_hold_any_prompt():
    config = EngineConfig(max_batched_tokens=64, chunked_prefill=False)
    assert config.scheduler_config(10, 2048, cp=1, layered=None).max_batched_tokens == 2048
    assert config.scheduler_config(10, 32, cp=1, layered=None).max_batched_tokens == 64, "already big enough"
    assert EngineConfig().scheduler_config(10, 2048, cp=1, layered=None).max_batched_tokens is None, "no budget"
    assert config.scheduler_config(10, 2048, cp=1, layered=LayeredPrefill(4)).layered is None


def test_context_parallel_takes_whole_prompts_and_no_prefix_cache():
    s = EngineConfig(prefix_caching=True).scheduler_config(10, 2048, cp=2, layered=None)
    assert s.whole_prompt_steps and not s.chunked_prefill and not s.prefix_caching


def test_the_cli_builds_the_config_from_its_flags():
    """launch/model_options.engine_config: the parallel flags into WorkerOptions, an unset
    threshold to the device's default, the scheduler's fields beside them."""
    from dist_infer.cli.parser import add_overlap_flags
    from dist_infer.launch.model_options import add_model_flags, add_scheduler_flags, engine_config, scheduler_options

    p = argparse.ArgumentParser()
    add_model_flags(p)
    add_scheduler_flags(p, offline=False)
    add_overlap_flags(p)
    args = p.parse_args(
        [
            "--overlap",
            "on",
            "--overlap-threshold",
            "512",
            "--block-size",
            "8",
            "--kv-blocks",
            "40",
            "--cp-variant",
            "pass-q",
            "--cuda-graphs",
            "off",
        ]
    )
    config = engine_config(args, heartbeat_s=1.5, **scheduler_options(args))
    assert (config.block_size, config.num_blocks, config.heartbeat_s) == (8, 40, 1.5)
    assert (config.worker.overlap, config.worker.overlap_threshold) == ("on", 512)
    assert (config.worker.cp_variant, config.worker.cuda_graphs) == ("pass-q", "off")
    assert config.worker.sequence_parallel_threshold == DEFAULT_SEQUENCE_PARALLEL_THRESHOLD
    assert config.prefix_caching is True, "the CLI's default, unlike the library's"

"""The model options every command takes: --quantization beside --dtype; the scheduling policy."""

from __future__ import annotations

import pytest

from dist_infer.cli.parser import build_parser


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_quantization_flag_beside_dtype(command):

    parser = build_parser()
    assert parser.parse_args([command]).quantization == "auto"
    assert parser.parse_args([command, "--quantization", "int4"]).quantization == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--quantization", "fp8"])


def test_scheduling_policy_flags_reach_the_scheduler_config():
    from dist_infer.engine.engine_config import EngineConfig
    from dist_infer.launch.model_options import scheduler_options

    parser = build_parser()
    args = parser.parse_args(["serve"])
    assert (args.scheduling_policy, args.prompt_max_wait_ms) == ("fcfs", 2000.0)
    args = parser.parse_args(["serve", "--scheduling-policy", "shortest-prompt", "--prompt-max-wait-ms", "500"])
    config = EngineConfig(**scheduler_options(args)).scheduler_config(64, 2048, 1, None)
    assert (config.policy, config.max_wait_s) == ("shortest-prompt", 0.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--scheduling-policy", "priority"])
    for bad in ("0", "-5", "nan", "soon"):  # refused as the flags are parsed, before any instance starts
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--prompt-max-wait-ms", bad])
    with pytest.raises(ValueError, match="max wait must be positive"):
        EngineConfig(scheduling_policy="shortest-prompt", prompt_max_wait_s=0.0)

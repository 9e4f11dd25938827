"""Hardware profiles: one at another machine speed (rates times the compute ratio, fixed costs
divided by it, bytes at the memory ratio), log interpolation, and errors that name the file, the
line and the field."""

from __future__ import annotations

import pytest

from dist_infer.bench.sweep import machine_speed
from dist_infer.planner.hardware import HardwareProfile, Link, ProfileError, interpolate_log, load_profile
from dist_infer.planner.layout import Layout
from dist_infer.planner.predict import predict
from dist_infer.planner.workload import Workload
from tests.support.plan_profiles import SMALL, gemm_only_profile


def test_a_profile_at_another_speed_scales_rates_and_fixed_costs():
    """A shared machine's speed moves (the same GEMM timing by a third within minutes here): bench
    --sweep times calibrate's reference again before each layout and predicts for the machine at
    that speed: FLOP rates times the compute ratio, fixed costs divided by it, bytes at the memory ratio."""
    hw = gemm_only_profile(
        rate=1e9,
        device="cpu",
        memory_bandwidth={"2": [[512, 4e9], [4096, 2e9]]},
        attention_flops={"fp32": {"2": {"64": [[128, 1e9]]}}},
        per_layer_s=1e-3,
        decode_fixed={"tp=2": {"per_layer_s": 2e-3, "per_step_s": 4e-3}},
        links={"intra": Link(1e-4, 1e9)},
        reference={"gemm_flops": 1e11, "stream_bandwidth": 2e10},
    )
    speed = machine_speed(hw.reference, {"gemm_flops": 5e10, "stream_bandwidth": 3e10})
    assert speed == {"compute": 0.5, "memory": 1.5}
    slow = hw.at_speed(**speed)
    assert slow.gemm_rate("fp32", 2, 10) == 0.5e9 and slow.attention_rate("fp32", 2, 128, 64) == 0.5e9
    assert slow.bandwidth(2, 512) == 6e9 and slow.bandwidth(2, 4096) == 3e9
    assert slow.per_layer_s == 2e-3 and slow.decode_fixed["tp=2"] == {"per_layer_s": 4e-3, "per_step_s": 8e-3}
    assert slow.links["intra"] == Link(2e-4, 1.5e9)
    work = Workload(batch=1, prompt_len=64, gen_len=2)
    assert predict(SMALL, Layout(), work, slow).prefill["gemm"] == pytest.approx(
        2 * predict(SMALL, Layout(), work, hw).prefill["gemm"]
    )
    assert hw.at_speed(1.0, 1.0) == hw


def test_interpolation_and_profile_errors(tmp_path):
    assert interpolate_log([[1, 10.0], [100, 30.0]], 10) == pytest.approx(20.0)
    assert interpolate_log([[1, 10.0], [100, 30.0]], 1000) == 30.0
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",\n "device": }\n')
    with pytest.raises(ProfileError, match=r"bad.json:2: not valid JSON"):
        load_profile(str(bad))
    with pytest.raises(ProfileError, match="missing field"):
        HardwareProfile.from_json({"name": "x"}, "p.json")
    with pytest.raises(ProfileError, match="no hardware profile 'nope'"):
        load_profile("nope")

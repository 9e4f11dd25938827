"""The chunked-against-layered prefill prediction (planner/prefill_schedule.py): the expert-read
arithmetic by hand, the step counts the engine's own rule gives, and where layered is refused."""

from __future__ import annotations

import dataclasses
import math

import pytest

from dist_infer.engine.layered_prefill import LayeredPrefill
from dist_infer.planner.layout import Layout
from dist_infer.planner.prefill_schedule import experts_touched, format_prefill_schedules, predict_prefill_schedules
from dist_infer.planner.workload import Setup, Workload
from tests.support.plan_profiles import SMALL, gemm_only_profile

MOE = dataclasses.replace(SMALL, experts=8, top_k=2, expert_intermediate=32, moe_layers=4)


def _setup(shape, layout=Layout(), rate=1e9):
    return Setup(shape, layout, Workload(batch=1, prompt_len=1, gen_len=1), gemm_only_profile(rate))


def test_experts_touched_by_hand():
    assert experts_touched(0, 8, 2) == 0 and experts_touched(5, 0, 0) == 0
    assert experts_touched(1, 8, 2) == pytest.approx(2.0), "one token: its top-2"
    assert experts_touched(2, 8, 2) == pytest.approx(8 * (1 - 0.75**2))
    assert experts_touched(10_000, 8, 2) == pytest.approx(8.0)


def test_layered_reads_each_expert_once_where_chunks_read_them_per_chunk():
    preds = predict_prefill_schedules(_setup(MOE), prompt=1000, budget=108, decodes=8)
    chunked, layered = preds["chunked"], preds["layered"]
    assert chunked.steps == 10, "1000 tokens, 100 a step beside 8 decodes"
    assert layered.steps == LayeredPrefill(MOE.layers).groups_for(1000, 100) == 4, (
        "the engine's rule: one per layer at most"
    )
    expert = 3 * MOE.hidden * MOE.expert_intermediate * 4  # fp32 bytes
    assert layered.expert_bytes == pytest.approx(MOE.moe_layers * 8 * expert)
    assert chunked.expert_bytes == pytest.approx(10 * layered.expert_bytes, rel=1e-6), "every chunk touches all 8"
    assert chunked.ttft_s == pytest.approx(sum([chunked.step_s] * 10), rel=0.5)


def test_gemm_time_is_the_same_work_cut_two_ways_on_a_dense_model():
    """With only GEMMs costing time, both schedules do the prompt's FLOPs once: the same TTFT."""
    preds = predict_prefill_schedules(_setup(SMALL), prompt=400, budget=100, decodes=0)
    assert preds["chunked"].expert_bytes == preds["layered"].expert_bytes == 0
    assert preds["chunked"].ttft_s == pytest.approx(preds["layered"].ttft_s, rel=1e-9)
    assert preds["layered"].steps == 4 and math.isclose(preds["layered"].step_s * 4, preds["layered"].ttft_s)


def test_layered_is_none_under_pp_or_cp_and_a_full_budget_is_refused():
    for layout in (Layout(pp=2), Layout(cp=2)):
        preds = predict_prefill_schedules(_setup(SMALL, layout), prompt=64, budget=32, decodes=0)
        assert preds["layered"] is None and preds["chunked"].steps == 2
        assert "not supported" in format_prefill_schedules(preds, layout, 64, 32, 0)
    with pytest.raises(ValueError, match="no room"):
        predict_prefill_schedules(_setup(SMALL), prompt=64, budget=8, decodes=8)

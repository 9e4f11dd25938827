"""The overlap report's arithmetic (bench.report_runs: what the overlap hid, from the base, overlapped
and no-comm runs) and the profile's buckets of operator names, in this process. (The reports from
real runs: tests/integration/test_shm_and_overlap.py.)"""

from __future__ import annotations

import pytest


def test_report_runs_and_profile_buckets():
    from dist_infer.bench import report_runs
    from dist_infer.bench.profile import op_bucket

    runs = {
        "base": {"ttft_s": 1.0, "tpot_s": 0.1},
        "overlap": {"ttft_s": 0.9, "tpot_s": 0.1},
        "nocomm": {"ttft_s": 0.8, "tpot_s": 0.08, "exposed_s": {"tp": {"all_reduce": 0.0}}},
    }
    r = report_runs(runs)
    assert r["hidden_fraction"] == pytest.approx(0.5) and r["exposed_s"] == pytest.approx(0.1)
    assert r["decode"]["hidden_fraction"] == pytest.approx(0.0)
    no_base = report_runs({k: v for k, v in runs.items() if k != "base"})
    assert no_base["t_base_s"] is None and no_base["hidden_fraction"] is None
    assert [
        op_bucket(n)
        for n in (
            "aten::mm",
            "dist_infer::skinny_linear",
            "aten::scaled_dot_product_attention",
            "dist_infer::decode_attention",
            "dist_infer::comm::tp.all_reduce",
            "gloo:all_reduce",
            "aten::mul",
        )
    ] == ["gemm", "gemm", "attention", "attention", "comm", "comm", "other"]

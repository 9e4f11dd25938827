"""The report's maths on hand-made records: latency statistics and TPOT, throughput and goodput,
the SLO's edge cases."""

from __future__ import annotations

import pytest

from dist_infer.bench.serve.client import RequestRecord
from dist_infer.bench.serve.report import latency_stats, meets_slo, summarize


def _record(index, ttft, e2e, tokens, success=True, error="", itl=(), input_len=10):
    return RequestRecord(
        index=index,
        input_len=input_len,
        output_len=tokens,
        ttft=ttft,
        e2e=e2e,
        output_tokens=tokens,
        success=success,
        error=error,
        itl=list(itl),
    )


def test_latency_stats_and_tpot():
    stats = latency_stats([0.1, 0.2, 0.3, 0.4])
    assert stats["mean"] == pytest.approx(250.0)
    assert stats["median"] == pytest.approx(250.0)
    assert stats["p99"] == pytest.approx(397.0)  # linear interpolation between 300 and 400
    assert stats["p90"] == pytest.approx(370.0)
    assert stats["max"] == pytest.approx(400.0)
    assert latency_stats([]) == {"mean": None, "median": None, "p90": None, "p99": None, "max": None}
    assert _record(0, ttft=0.1, e2e=1.0, tokens=10).tpot == pytest.approx(0.1)
    assert _record(0, ttft=0.1, e2e=1.0, tokens=1).tpot is None
    assert _record(0, ttft=None, e2e=1.0, tokens=0, success=False).tpot is None


def test_summarize_counts_throughput_and_goodput():
    records = [
        _record(0, ttft=0.1, e2e=1.0, tokens=10, itl=[0.1] * 9),  # tpot 0.1
        _record(1, ttft=0.2, e2e=0.6, tokens=5, itl=[0.1] * 4),  # tpot 0.1
        _record(2, ttft=0.9, e2e=1.9, tokens=11, itl=[0.1] * 10),  # tpot 0.1, ttft too slow for 0.5
        _record(3, ttft=None, e2e=0.01, tokens=0, success=False, error="HTTP 400: bad"),
    ]
    summary = summarize(records, duration_s=2.0, slo={"ttft": 0.5})
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["total_output_tokens"] == 26
    assert summary["total_input_tokens"] == 30
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(13.0)
    assert summary["total_token_throughput"] == pytest.approx(28.0)
    assert summary["goodput"] == pytest.approx(1.0)  # 2 of the 3 meet ttft <= 0.5 s, over 2 s
    assert summary["errors"] == {"HTTP 400: bad": 1}
    many = summarize([_record(i, None, 0.1, 0, success=False, error=f"e{i % 12}") for i in range(24)], 1.0)
    assert len(many["errors"]) == 11 and many["errors"]["(2 other error texts)"] == 4
    assert summary["ttft_ms"]["median"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(100.0)
    assert summary["e2e_ms"]["mean"] == pytest.approx(3500.0 / 3)
    assert summarize(records, 2.0, slo={"ttft": 1.0, "e2e": 0.8})["goodput"] == pytest.approx(0.5)
    assert summarize(records, 2.0)["goodput"] is None
    assert summarize(records, 2.0, slo={"tpot": 0.05})["goodput"] == 0.0


def test_meets_slo_edge_cases():
    one_token = _record(0, ttft=0.1, e2e=0.1, tokens=1)
    assert meets_slo(one_token, {"tpot": 0.001})  # no gaps, nothing to break
    no_content = _record(1, ttft=None, e2e=0.3, tokens=0)
    assert meets_slo(no_content, {"ttft": 0.5}) and not meets_slo(no_content, {"ttft": 0.2})
    assert not meets_slo(_record(2, ttft=0.1, e2e=0.2, tokens=3, success=False), {"ttft": 1.0})

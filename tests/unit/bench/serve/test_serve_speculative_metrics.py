"""Speculation over a run from /metrics: the counters summed over instances, the summary of two
scrapes (None without counters, after a restart, or with nothing proposed), and its report line."""

from __future__ import annotations

import pytest

from dist_infer.bench.serve.speculative_metrics import (
    parse_speculative_counters,
    speculative_report_line,
    speculative_summary,
)


def exposition(drafts: int, proposed: int, accepted: int) -> str:
    return (
        "# TYPE dist_infer:spec_decode_num_drafts_total counter\n"
        f'dist_infer:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}\n'
        f'dist_infer:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {proposed - 10}\n'
        f'dist_infer:spec_decode_num_draft_tokens_total{{engine="1",model_name="m"}} 10\n'
        f'dist_infer:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}\n'
        f'dist_infer:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} 7\n'
    )


def test_two_scrapes_give_the_acceptance_and_tokens_a_round():
    got = speculative_summary(
        parse_speculative_counters(exposition(10, 40, 20)), parse_speculative_counters(exposition(60, 240, 170))
    )
    assert got["spec_draft_tokens"] == 200 and got["spec_accepted_tokens"] == 150
    assert got["spec_acceptance"] == pytest.approx(0.75) and got["spec_tokens_per_round"] == pytest.approx(4.0)
    assert "150 of 200 proposals kept (75.0%), 4.00 tokens a round" in speculative_report_line(got)


@pytest.mark.parametrize(
    "before, after",
    [
        (None, exposition(1, 20, 1)),
        ("# nothing here\n", exposition(1, 20, 1)),
        (exposition(60, 240, 170), exposition(10, 40, 20)),  # a restart: the counters went back
        (exposition(10, 40, 20), exposition(10, 40, 20)),  # nothing proposed during the run
    ],
)
def test_no_counters_a_restart_or_nothing_proposed_give_none(before, after):
    got = speculative_summary(parse_speculative_counters(before), parse_speculative_counters(after))
    assert all(v is None for v in got.values()) and speculative_report_line(got) is None

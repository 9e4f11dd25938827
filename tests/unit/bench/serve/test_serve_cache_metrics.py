"""The prefix cache hit rate from /metrics: counters summed over labels under either prefix
(dist_infer, vllm), absent counters, the summary of two scrapes, and a shared-prefix run against a
fake server that counts hits (tests/support/fake_openai_servers.py)."""

from __future__ import annotations

import pytest

from dist_infer.bench.serve.cache_metrics import CacheCounters, cache_report_line, cache_summary, parse_cache_counters
from dist_infer.bench.serve.command import main
from tests.support.bench_serve_inputs import last_json
from tests.support.fake_openai_servers import make_chat_server, serving

METRICS_TEXT = """# HELP {p}:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.
# TYPE {p}:prefix_cache_queries_total counter
{p}:prefix_cache_queries_total{{engine="0",model_name="m {{x}}"}} 600.0
{p}:prefix_cache_queries_total{{engine="1"}} 400
{p}:prefix_cache_queries_created{{engine="0"}} 1.7e9
{p}:prefix_cache_hits_total{{engine="0"}} 250 1712345678000
{p}:prefix_cache_hits_total{{engine="1"}} 50
{p}:prefix_cache_hits_total_other 99
other_metric 3
"""


@pytest.mark.parametrize("prefix", ["dist_infer", "vllm"])
def test_cache_counters_are_summed_over_labels_for_either_prefix(prefix):
    assert parse_cache_counters(METRICS_TEXT.format(p=prefix)) == CacheCounters(1000.0, 300.0)


def test_cache_counters_absent_and_the_summary_of_two_scrapes():
    assert parse_cache_counters("") is None
    assert parse_cache_counters("# nothing\nvllm:num_requests_running 2\nprefix_cache_queries_total 5\n") is None
    assert parse_cache_counters("dist_infer:prefix_cache_queries_total 7\n") == CacheCounters(7.0, 0.0)
    before, after = CacheCounters(1000, 300), CacheCounters(1800, 900)
    assert cache_summary(before, after) == {
        "prefix_cache_hit_rate": 0.75,
        "prefix_cache_queries": 800,
        "prefix_cache_hits": 600,
    }
    empty = {"prefix_cache_hit_rate": None, "prefix_cache_queries": None, "prefix_cache_hits": None}
    assert cache_summary(None, after) == empty and cache_summary(before, None) == empty
    assert cache_summary(after, before) == empty  # counters went back: the server restarted
    assert cache_summary(before, before) == empty  # nothing looked up
    assert "75.0%  (600 of 800 prompt tokens)" in cache_report_line(cache_summary(before, after))
    assert cache_report_line(empty).startswith("Prefix cache hit rate:") and "- (" in cache_report_line(empty)


def test_prefix_dataset_run_reports_the_hit_rate(capsys):
    app, seen, counters = make_chat_server(key=lambda body: tuple(body["prompt"][:8]))
    with serving(app) as url:
        code = main(
            [
                "--url",
                url,
                "--dataset",
                "prefix",
                "--prompt-ids",
                "--num-prompts",
                "8",
                "--num-prefixes",
                "2",
                "--prefix-len",
                "8",
                "--suffix-len",
                "4",
                "--output-len",
                "2",
                "--max-concurrency",
                "1",
                "--json",
            ]
        )
    out = capsys.readouterr().out
    assert code == 0, out
    summary = last_json(out)
    assert summary["prefix_cache_queries"] == 8 * 12 == counters["queries"] - 1000
    # one at a time: the first request of each prefix hits nothing, the other six their prefix (or more)
    assert summary["prefix_cache_hits"] >= 6 * 8
    assert summary["ttft_ms_by_turn"] is None and summary["num_conversations"] is None
    assert "vs turn 1" not in out

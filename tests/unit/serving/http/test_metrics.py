"""The metrics collector's structured-output and speculative counters: an engine's counters cross
the wire in its stats and come out per instance under `dist_infer:structured_*` and
`dist_infer:spec_decode_*` (vLLM's names), zero where an instance has none."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dist_infer.engine.speculative.counters import SpeculativeCounters
from dist_infer.engine.structured.counters import StructuredCounters
from dist_infer.serving.fleet.wire import InstanceStats
from dist_infer.serving.http.metrics import EngineStatsCollector


def samples(text: str) -> dict:
    return {
        (s.name, s.labels.get("engine")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("dist_infer:structured_")
    }


def test_structured_counters_per_instance():
    counters = StructuredCounters()
    counters.add(grammar_compiles=2, grammar_cache_hits=5, mask_rows=40, mask_seconds=0.5, mask_wait_seconds=0.125)
    crossed = InstanceStats.from_dict({"structured": counters.snapshot()}).as_dict()  # what the instance sends
    stats = {"instances": [dict(crossed, engine="0"), dict(InstanceStats().as_dict(), engine="1")]}
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, "m"))
    got = samples(generate_latest(registry).decode())
    assert got[("dist_infer:structured_grammar_compiles_total", "0")] == 2
    assert got[("dist_infer:structured_grammar_cache_hits_total", "0")] == 5
    assert got[("dist_infer:structured_mask_rows_total", "0")] == 40
    assert got[("dist_infer:structured_mask_seconds_total", "0")] == 0.5
    assert got[("dist_infer:structured_mask_wait_seconds_total", "0")] == 0.125
    assert got[("dist_infer:structured_mask_rows_total", "1")] == 0, "an instance without counters reports zeros"
    names = {name for name, _ in got}
    assert names == {f"dist_infer:structured_{k}_total" for k in counters.snapshot()}


def test_speculative_counters_per_instance_and_position():
    counters = SpeculativeCounters(3)
    for proposed, accepted in [(3, 3), (3, 1), (2, 0), (1, 1)]:
        counters.record(proposed, accepted)
    crossed = InstanceStats.from_dict({"speculative": counters.snapshot()}).as_dict()
    stats = {"instances": [dict(crossed, engine="0"), dict(InstanceStats().as_dict(), engine="1")]}
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, "m"))
    text = generate_latest(registry).decode()
    got = {
        (s.name, s.labels.get("engine"), s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("dist_infer:spec_decode_")
    }
    assert got[("dist_infer:spec_decode_num_drafts_total", "0", None)] == 4
    assert got[("dist_infer:spec_decode_num_draft_tokens_total", "0", None)] == 9
    assert got[("dist_infer:spec_decode_num_accepted_tokens_total", "0", None)] == 5
    assert got[("dist_infer:spec_decode_num_accepted_tokens_total", "1", None)] == 0, "none: zeros"
    per_pos = {p: v for (name, e, p), v in got.items() if name.endswith("per_pos_total") and e == "0"}
    assert per_pos == {"0": 3, "1": 1, "2": 1}

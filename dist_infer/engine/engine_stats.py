"""What an engine reports to /metrics, the hub and the autoscaler: one dict, read at scrape time.

Mostly the scheduler's state (queues, blocks, preemptions, the prefix cache); the step loop adds
the adds it applied, the step durations and the predicted prefill backlog. Before the cache
exists (offline, before the first batch) it is all zeros.
"""

from __future__ import annotations

from typing import Optional

from dist_infer.engine.block_demand import growth_demand, waiting_demand
from dist_infer.engine.step_pacing import StepPacer

EMPTY = {
    "num_requests_running": 0,
    "num_requests_waiting": 0,
    "kv_cache_usage_perc": 0.0,
    "num_preemptions_total": 0,
    "free_blocks": 0,
    "total_blocks": 0,
    "cached_blocks": 0,
    "prefix_cache_queries": 0,
    "prefix_cache_hits": 0,
}


def engine_stats(
    scheduler,
    requests_added: int,
    pacer: StepPacer,
    structured: Optional[dict] = None,
    speculative: Optional[dict] = None,
) -> dict:
    """The stats of an engine whose scheduler is `scheduler` (None: no cache yet), which applied
    `requests_added` adds and paces its steps with `pacer`; `structured`: its structured-output
    counters (engine/structured/counters.py); `speculative`: speculative decoding's
    (engine/speculative/counters.py)."""
    s = scheduler
    if s is None:
        return dict(EMPTY, structured=structured, speculative=speculative)
    return {
        "num_requests_running": len(s.running),
        "num_requests_waiting": len(s.waiting),
        "kv_cache_usage_perc": s.usage,
        "num_preemptions_total": s.num_preemptions,
        "free_blocks": s.num_free_blocks,
        "total_blocks": s.config.num_blocks,
        "cached_blocks": s.num_cached_blocks,  # of free_blocks: cached prefixes, evicted when needed
        "prefix_cache_queries": s.prefix_cache_queries,
        "prefix_cache_hits": s.prefix_cache_hits,
        "watermark_blocks": s.watermark_blocks,
        "waiting_demand_blocks": waiting_demand(s),
        "growth_blocks": growth_demand(s),
        "running_ids": [r.request_id for r in s.running],
        "waiting_ids": [r.request_id for r in s.waiting],
        "running_blocks": [len(r.block_table) for r in s.running],
        "requests_added": requests_added,
        "step_seconds": pacer.step_times.snapshot(),
        "prefill_backlog_s": pacer.prefill_backlog_s(s.waiting, s.running),
        "structured": structured,
        "speculative": speculative,
    }

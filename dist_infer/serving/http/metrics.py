"""Prometheus metrics of the HTTP server, named as vLLM names them (`dist_infer:` for `vllm:`)
so existing dashboards work by changing the prefix.

Each app owns its registry (several apps in one process, as in tests, must not clash on the
global one). The engine's state (running, waiting, KV cache use, preemptions) is read from
engine.stats() at scrape time; latencies and token counts are measured here, in the process
that owns every client's stream, from the request's arrival to when each delta reached the
server.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from loguru import logger
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from dist_infer.engine.request import RequestOutput
from dist_infer.serving.http.mirror_metrics import kv_mirror_families

PREFIX = "dist_infer:"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out) or (1.0,)
            out.append(float(m * scale))
        scale *= 10


def cumulative_buckets(bounds, counts) -> list[tuple[str, float]]:
    """Counts per bucket (+Inf last) -> Prometheus' cumulative (upper bound, count) pairs."""
    cumulative, running = [], 0
    for bound, n in zip(list(bounds) + [float("inf")], counts):
        running += n
        cumulative.append((str(bound) if bound != float("inf") else "+Inf", float(running)))
    return cumulative


class EngineStatsCollector:
    """Gauges, the preemption and prefix cache counters, read from engine.stats() when Prometheus scrapes."""

    GAUGES = {
        "num_requests_running": "Requests in the running batch (they hold KV blocks).",
        "num_requests_waiting": "Requests waiting for admission (new or preempted).",
        "kv_cache_usage_perc": "Fraction of KV cache blocks in use, 0..1.",
    }

    def __init__(self, stats: Callable[[], dict], model_name: str, prefix_cache_counters: bool = True):
        self.stats = stats
        self.model_name = model_name
        self.prefix_cache_counters = prefix_cache_counters  # False: left out (a side channel; HttpGuard says when)

    def _families(self, stats: Optional[dict]) -> list[Metric]:
        """The gauges per instance (vLLM's `engine` label, the instance index) when the server
        runs several, else per model; then the preemption and migration counters."""
        per = (stats or {}).get("instances") or ([dict(stats, engine="0")] if stats is not None else [])
        families: list[Metric] = []
        for key, doc in self.GAUGES.items():
            g = GaugeMetricFamily(PREFIX + key, doc, labels=["model_name", "engine"])
            for s in per:
                g.add_metric([self.model_name, s["engine"]], float(s.get(key, 0.0)))
            families.append(g)
        c = CounterMetricFamily(
            PREFIX + "num_preemptions",
            "Requests preempted (KV blocks taken back) so far.",
            labels=["model_name", "engine"],
        )
        for s in per:
            c.add_metric([self.model_name, s["engine"]], float(s.get("num_preemptions_total", 0)))
        families.append(c)
        if self.prefix_cache_counters:
            for key, doc in (
                ("prefix_cache_queries", "Prefix cache queries: tokens of admitted requests looked up."),
                ("prefix_cache_hits", "Prefix cache hits: queried tokens found cached, not computed."),
            ):
                c = CounterMetricFamily(PREFIX + key, doc, labels=["model_name", "engine"])
                for s in per:
                    c.add_metric([self.model_name, s["engine"]], float(s.get(key, 0)))
                families.append(c)
        m = CounterMetricFamily(
            PREFIX + "migrations",
            "Live request migrations between instances, by outcome "
            "(ok, or why not: no_room, source_ended, source_preempted, dest_failed, ...).",
            labels=["model_name", "outcome"],
        )
        for outcome, n in sorted((stats or {}).get("migrations_total", {}).items()):
            m.add_metric([self.model_name, outcome], float(n))
        families.append(m)
        families.append(self._step_histogram(per))
        families += self._structured_counters(per)
        families += self._speculative_counters(per)
        families += kv_mirror_families(self.model_name, per)
        families.append(
            self._histogram(
                stats,
                "migration_downtime",
                "migration_downtime_seconds",
                "Time a migrated request did not run: from its pause on the source to its "
                "commit on the destination (seconds).",
            )
        )
        families.append(
            self._histogram(
                stats,
                "requests_recovered",
                "request_recovery_seconds",
                "Requests whose instance died and that streamed on from another: time from "
                "the death to their next token (seconds).",
            )
        )
        for key, name, doc in (
            ("instance_failures_total", "instance_failures", "Instances that died."),
            (
                "requests_lost_total",
                "requests_lost",
                "Requests that ended with an error because their instance died and no other could take them over.",
            ),
            (
                "requests_quarantined_total",
                "requests_quarantined",
                "Requests failed instead of dispatched again: the instances running them died more "
                "than --max-request-failovers times.",
            ),
        ):
            if stats is None or key in stats:
                c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
                c.add_metric([self.model_name], float((stats or {}).get(key, 0)))
                families.append(c)
        if stats is None or "autoscale_decisions_total" in stats:
            c = CounterMetricFamily(
                PREFIX + "autoscale_decisions",
                "The autoscaler's decisions, by action (up, down; _failed: decided but not done).",
                labels=["model_name", "action"],
            )
            for action, n in sorted((stats or {}).get("autoscale_decisions_total", {}).items()):
                c.add_metric([self.model_name, action], float(n))
            families.append(c)
        if stats is None or "frontend_entries" in stats:
            g = GaugeMetricFamily(
                PREFIX + "frontend_entries",
                "Entries the front end holds for requests and "
                "migrations in flight, by kind (all 0 when idle: nothing outlives its request).",
                labels=["model_name", "kind"],
            )
            for kind, n in sorted((stats or {}).get("frontend_entries", {}).items()):
                g.add_metric([self.model_name, kind], float(n))
            families.append(g)
        return families

    STRUCTURED = {
        "grammar_compiles": "Structured-output specs compiled into grammars (cache misses).",
        "grammar_compile_seconds": "Seconds spent compiling grammars and building their start states.",
        "grammar_cache_hits": "Structured-output specs found compiled already.",
        "matchers_started": "Grammar states made for requests (new, resumed after a failure, migrated in).",
        "mask_steps": "Steps with at least one constrained row (their masks computed together).",
        "mask_rows": "Constrained rows whose token mask was computed (one per sampled token).",
        "mask_seconds": "Seconds computing token masks (on the mask filler's thread, beside the forward).",
        "mask_wait_seconds": "Seconds the sampler waited for token masks: the part the forward did not hide.",
    }

    def _structured_counters(self, per: list[dict]) -> list[Metric]:
        """Each instance's structured-output counters (engine/structured/counters.py)."""
        families: list[Metric] = []
        for key, doc in self.STRUCTURED.items():
            c = CounterMetricFamily(PREFIX + "structured_" + key, doc, labels=["model_name", "engine"])
            for s in per:
                c.add_metric([self.model_name, s["engine"]], float((s.get("structured") or {}).get(key, 0)))
            families.append(c)
        return families

    SPECULATIVE = {
        "num_drafts": "Speculative rounds: steps in which a request's proposed tokens were checked.",
        "num_draft_tokens": "Proposed tokens checked by the model (speculative decoding).",
        "num_accepted_tokens": "Proposed tokens the model kept: each saved a step.",
    }

    def _speculative_counters(self, per: list[dict]) -> list[Metric]:
        """Each instance's speculative decoding counters (engine/speculative/counters.py), under
        vLLM's names (spec_decode_*), and the accepted tokens by position in their round."""
        families: list[Metric] = []
        for key, doc in self.SPECULATIVE.items():
            c = CounterMetricFamily(PREFIX + "spec_decode_" + key, doc, labels=["model_name", "engine"])
            for s in per:
                c.add_metric([self.model_name, s["engine"]], float((s.get("speculative") or {}).get(key, 0)))
            families.append(c)
        c = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposed tokens by their position in the round (0: the first proposal).",
            labels=["model_name", "engine", "position"],
        )
        for s in per:
            for position, n in enumerate((s.get("speculative") or {}).get("accepted_per_pos", [])):
                c.add_metric([self.model_name, s["engine"], str(position)], float(n))
        families.append(c)
        return families

    def _step_histogram(self, per: list[dict]) -> HistogramMetricFamily:
        """Each instance's forward-step durations by kind: decode (decodes only), mixed (a prompt
        chunk beside decodes: what --itl-target-ms sizes) and prefill (prompts only)."""
        h = HistogramMetricFamily(
            PREFIX + "step_duration_seconds",
            "Forward steps of each instance by kind (decode, mixed, prefill): seconds per step.",
            labels=["model_name", "engine", "kind"],
        )
        for s in per:
            for kind, (bounds, counts, total) in sorted((s.get("step_seconds") or {}).items()):
                h.add_metric([self.model_name, s["engine"], kind], cumulative_buckets(bounds, counts), total)
        return h

    def _histogram(self, stats: Optional[dict], key: str, name: str, doc: str) -> HistogramMetricFamily:
        """A histogram from a stats entry (bucket bounds, counts per bucket, sum)."""
        h = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
        entry = (stats or {}).get(key)
        if entry is not None:
            bounds, counts, total = entry
            h.add_metric([self.model_name], cumulative_buckets(bounds, counts), total)
        return h

    def describe(self):
        return self._families(None)

    def collect(self):
        try:
            stats = self.stats()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because the engine did
            logger.debug(f"engine.stats() failed during a metrics scrape: {exc}")
            stats = None
        return self._families(stats)


class ServingMetrics:
    """The app's registry and the request-level series; `request()` gives one request's clock."""

    def __init__(
        self, model_name: str, stats: Callable[[], dict], max_model_len: int, prefix_cache_counters: bool = True
    ):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(stats, model_name, prefix_cache_counters))
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", labels, registry=reg)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests finished, by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival to the first token (seconds).",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between tokens of a request (seconds).",
            labels,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to the last token (seconds).",
            labels,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        token_buckets = buckets_1_2_5(max(1, max_model_len))
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens",
            "Prompt length of finished requests.",
            labels,
            buckets=token_buckets,
            registry=reg,
        )
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Tokens generated by finished requests.",
            labels,
            buckets=token_buckets,
            registry=reg,
        )

    def request(self, arrival: Optional[float] = None, num_prompt_tokens: int = 0) -> "RequestClock":
        return RequestClock(self, time.monotonic() if arrival is None else arrival, num_prompt_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestClock:
    """One request's timings: feed it each delta as it reaches the server, then its end (once)."""

    def __init__(self, metrics: ServingMetrics, arrival: float, num_prompt_tokens: int = 0):
        self.metrics = metrics
        self.arrival = arrival
        self.last_token_time: Optional[float] = None
        self.num_prompt_tokens = num_prompt_tokens
        self.num_generated = 0
        self.ended = False

    def on_output(self, output: RequestOutput, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        m, name = self.metrics, self.metrics.model_name
        n = len(output.new_token_ids)
        if n == 0:
            return
        if self.last_token_time is None:
            self.num_prompt_tokens = output.num_prompt_tokens or self.num_prompt_tokens
            m.prompt_tokens.labels(name).inc(self.num_prompt_tokens)
            m.ttft.labels(name).observe(now - self.arrival)
            n_gaps = n - 1  # several tokens in the first delta arrived together
            gap = 0.0
        else:
            n_gaps = n
            gap = (now - self.last_token_time) / n
        for _ in range(n_gaps):
            m.itl.labels(name).observe(gap)
        m.generation_tokens.labels(name).inc(n)
        self.num_generated += n
        self.last_token_time = now

    def on_end(self, finish_reason: Optional[str], now: Optional[float] = None) -> None:
        if self.ended:
            return
        self.ended = True
        now = time.monotonic() if now is None else now
        m, name = self.metrics, self.metrics.model_name
        m.request_success.labels(name, finish_reason or "abort").inc()
        m.e2e.labels(name).observe(now - self.arrival)
        m.request_prompt_tokens.labels(name).observe(self.num_prompt_tokens)
        m.request_generation_tokens.labels(name).observe(self.num_generated)

"""KV mirroring's metrics (--kv-mirror; engine/mirror/, serving/mirror/): per instance, what it
sent its buddy, what it holds for others, how far behind its requests' mirrors are, what the
step loop spent on it, and what failovers onto it computed again."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

PREFIX = "dist_infer:"
LAG_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)

COUNTERS = {
    "blocks_sent": ("kv_mirror_blocks_sent", "KV blocks this instance mirrored to its buddy."),
    "bytes_sent": ("kv_mirror_bytes", "Bytes of KV this instance mirrored to its buddy."),
    "blocks_received": ("kv_mirror_blocks_received", "Mirrored KV blocks received from other instances."),
    "blocks_already_held": (
        "kv_mirror_blocks_already_held",
        "Mirrored blocks this instance's prefix cache held already (leased, not sent).",
    ),
    "blocks_refused": (
        "kv_mirror_blocks_refused",
        "Blocks offered to this instance that it had no room for (spare blocks or --kv-mirror-fraction).",
    ),
    "blocks_reclaimed": (
        "kv_mirror_blocks_reclaimed",
        "Mirrored blocks taken back for this instance's own requests (mirrors go first under pressure).",
    ),
    "step_wait_seconds": (
        "kv_mirror_step_wait_seconds",
        "Seconds the step loop spent on mirroring and KV sends (bookkeeping and the small inline sends).",
    ),
    "failover_recomputed_tokens": (
        "kv_mirror_failover_recomputed_tokens",
        "Tokens requests failed over to this instance computed again (the rest were mirrored or cached).",
    ),
}
GAUGES = {
    "lag_blocks": ("kv_mirror_lag_blocks", "Full KV blocks of running requests not mirrored yet."),
    "leased_blocks": ("kv_mirror_leased_blocks", "Blocks this instance holds as mirrors of other instances' requests."),
}


def kv_mirror_families(model_name: str, per: list[dict]) -> list[Metric]:
    """The families from each instance's stats entry (`kv_mirror`, absent when it does not migrate)."""
    families: list[Metric] = []
    for table, kind in ((COUNTERS, CounterMetricFamily), (GAUGES, GaugeMetricFamily)):
        for key, (name, doc) in table.items():
            m = kind(PREFIX + name, doc, labels=["model_name", "engine"])
            for s in per:
                m.add_metric([model_name, s["engine"]], float((s.get("kv_mirror") or {}).get(key, 0)))
            families.append(m)
    h = HistogramMetricFamily(
        PREFIX + "kv_mirror_request_lag_blocks",
        "Each running request's unmirrored full blocks, sampled at every mirroring round of its instance; phase "
        "'prompt' while blocks of its prompt are among them (a prompt step fills many at once), else 'output'.",
        labels=["model_name", "engine", "phase"],
    )
    for s in per:
        for phase, samples in lag_samples(s.get("kv_mirror")).items():
            if samples:
                h.add_metric(
                    [model_name, s["engine"], phase],
                    lag_buckets(samples),
                    float(sum(k * n for k, n in samples.items())),
                )
    families.append(h)
    return families


def lag_samples(snapshot: dict | None) -> dict[str, dict[int, int]]:
    """An instance's lag samples by phase, {phase: {lag: count}}, from its stats entry (JSON keys are strings)."""
    raw = (snapshot or {}).get("lag_samples") or {}
    return {phase: {int(k): n for k, n in samples.items()} for phase, samples in raw.items()}


def lag_buckets(samples: dict[int, int]) -> list[tuple[str, float]]:
    """Cumulative (le, count) buckets of lag samples {lag: count}."""
    below = [(str(float(b)), float(sum(n for k, n in samples.items() if k <= b))) for b in LAG_BOUNDS]
    return below + [("+Inf", float(sum(samples.values())))]


def lag_quantile(samples: dict[int, int], q: float) -> int:
    """The q-quantile of lag samples {lag: count} (0 for none)."""
    n = sum(samples.values())
    seen = 0
    for lag in sorted(samples):
        seen += samples[lag]
        if seen >= q * n:
            return lag
    return 0

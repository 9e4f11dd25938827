"""KV mirroring's metrics (serving/http/mirror_metrics.py): the families under their names, per
instance, and the per-request lag histogram from the instances' samples."""

from __future__ import annotations

from dist_infer.serving.http.mirror_metrics import kv_mirror_families, lag_buckets, lag_quantile


def test_the_families_per_instance():
    per = [
        {
            "engine": "0",
            "kv_mirror": {
                "blocks_sent": 5,
                "bytes_sent": 500,
                "lag_blocks": 2,
                "lag_samples": {"prompt": {"16": 1}, "output": {"0": 3, "4": 1}},
            },
        },
        {"engine": "1", "kv_mirror": None},
    ]
    families = {f.name: f for f in kv_mirror_families("m", per)}
    for name in (
        "dist_infer:kv_mirror_blocks_sent",
        "dist_infer:kv_mirror_bytes",
        "dist_infer:kv_mirror_lag_blocks",
        "dist_infer:kv_mirror_failover_recomputed_tokens",
        "dist_infer:kv_mirror_step_wait_seconds",
        "dist_infer:kv_mirror_request_lag_blocks",
    ):
        assert name in families, name
    sent = {s.labels["engine"]: s.value for s in families["dist_infer:kv_mirror_blocks_sent"].samples}
    assert sent == {"0": 5.0, "1": 0.0}
    lag = families["dist_infer:kv_mirror_request_lag_blocks"].samples
    by_phase = {
        phase: {s.labels.get("le"): s.value for s in lag if s.name.endswith("_bucket") and s.labels["phase"] == phase}
        for phase in ("prompt", "output")
    }
    assert by_phase["output"]["2.0"] == 3.0 and by_phase["output"]["+Inf"] == 4.0
    assert by_phase["prompt"]["8.0"] == 0.0 and by_phase["prompt"]["16.0"] == 1.0


def test_lag_buckets_and_quantiles():
    samples = {0: 90, 1: 8, 16: 2}
    buckets = dict(lag_buckets(samples))
    assert buckets["0.0"] == 90 and buckets["1.0"] == 98 and buckets["16.0"] == 100 and buckets["+Inf"] == 100
    assert lag_quantile(samples, 0.5) == 0 and lag_quantile(samples, 0.98) == 1 and lag_quantile(samples, 0.99) == 16
    assert lag_quantile({}, 0.99) == 0

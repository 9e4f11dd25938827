"""What speculative decoding did over a run, from the server's Prometheus `/metrics` scraped before
and after (this project's `dist_infer:spec_decode_*` counters, vLLM's names after the prefix; a
server without them gives None): proposals checked and kept, the acceptance rate, and the mean
tokens a speculating round emitted (the kept proposals and the target's own one)."""

from __future__ import annotations

from typing import Any, Optional

from dist_infer.bench.serve.cache_metrics import counter_sums

COUNTERS = {
    "drafts": "dist_infer:spec_decode_num_drafts_total",
    "draft_tokens": "dist_infer:spec_decode_num_draft_tokens_total",
    "accepted": "dist_infer:spec_decode_num_accepted_tokens_total",
}
EMPTY = {
    "spec_draft_tokens": None,
    "spec_accepted_tokens": None,
    "spec_acceptance": None,
    "spec_tokens_per_round": None,
}


def parse_speculative_counters(text: Optional[str]) -> Optional[dict[str, float]]:
    """COUNTERS' values in an exposition text, each summed over its labels; None without them."""
    if text is None:
        return None
    sums = counter_sums(text, COUNTERS)
    if any(v is None for v in sums.values()):
        return None
    return {k: float(v or 0.0) for k, v in sums.items()}


def speculative_summary(before: Optional[dict], after: Optional[dict]) -> dict[str, Any]:
    """The run's proposals and what came of them; all None without counters, after a restart
    (counters went backwards) or when nothing was proposed."""
    if before is None or after is None:
        return dict(EMPTY)
    delta = {k: after[k] - before[k] for k in COUNTERS}
    if any(v < 0 for v in delta.values()) or delta["draft_tokens"] <= 0 or delta["drafts"] <= 0:
        return dict(EMPTY)
    return {
        "spec_draft_tokens": delta["draft_tokens"],
        "spec_accepted_tokens": delta["accepted"],
        "spec_acceptance": delta["accepted"] / delta["draft_tokens"],
        "spec_tokens_per_round": 1.0 + delta["accepted"] / delta["drafts"],
    }


def speculative_report_line(summary: dict[str, Any], width: int = 33) -> Optional[str]:
    """The table's line for speculation; None when the server proposed nothing."""
    if not summary.get("spec_draft_tokens"):
        return None
    value = (
        f"{summary['spec_accepted_tokens']:.0f} of {summary['spec_draft_tokens']:.0f} proposals kept "
        f"({100 * summary['spec_acceptance']:.1f}%), {summary['spec_tokens_per_round']:.2f} tokens a round"
    )
    return f"{'Speculative decoding:':<{width}}{value}"

"""The grammar's share of the server's step time over a run, from its Prometheus `/metrics`
scraped before and after (this project's `dist_infer:structured_*` counters; a server without
them, llama.cpp's or vLLM's, gives None: the share is an extra).

`grammar_mask_s` is the time spent computing token masks, `grammar_mask_wait_s` the part of it
the sampler waited for (what the forward did not hide), `grammar_step_s` the steps' total time;
the shares are of that total.
"""

from __future__ import annotations

from typing import Any, Optional

from dist_infer.bench.serve.cache_metrics import counter_sums

COUNTERS = {
    "mask_s": "dist_infer:structured_mask_seconds_total",
    "mask_wait_s": "dist_infer:structured_mask_wait_seconds_total",
    "rows": "dist_infer:structured_mask_rows_total",
    "step_s": "dist_infer:step_duration_seconds_sum",
}
EMPTY = {
    "grammar_mask_s": None,
    "grammar_mask_wait_s": None,
    "grammar_step_s": None,
    "grammar_masked_rows": None,
    "grammar_share_of_step": None,
    "grammar_wait_share_of_step": None,
    "grammar_hidden": None,
}


def parse_grammar_counters(text: Optional[str]) -> Optional[dict[str, float]]:
    """COUNTERS' values in an exposition text, each summed over its labels; None without the mask counter."""
    if text is None:
        return None
    sums = counter_sums(text, COUNTERS)
    if sums["mask_s"] is None or sums["step_s"] is None:
        return None
    return {k: v or 0.0 for k, v in sums.items()}


def grammar_summary(before: Optional[dict], after: Optional[dict]) -> dict[str, Any]:
    """The run's mask and step seconds and their shares; all None without counters, after a
    restart (counters went backwards) or with no step run."""
    if before is None or after is None:
        return dict(EMPTY)
    delta = {k: after[k] - before[k] for k in COUNTERS}
    if any(v < 0 for v in delta.values()) or delta["step_s"] <= 0:
        return dict(EMPTY)
    mask, wait, step = delta["mask_s"], delta["mask_wait_s"], delta["step_s"]
    return {
        "grammar_mask_s": mask,
        "grammar_mask_wait_s": wait,
        "grammar_step_s": step,
        "grammar_masked_rows": delta["rows"],
        "grammar_share_of_step": mask / step,
        "grammar_wait_share_of_step": wait / step,
        "grammar_hidden": 1.0 - min(wait, mask) / mask if mask > 0 else None,
    }


def grammar_report_line(summary: dict[str, Any], width: int = 33) -> Optional[str]:
    """The table's line for the grammar's time; None when the server reported no masks."""
    if not summary.get("grammar_masked_rows"):
        return None
    value = (
        f"masks {summary['grammar_mask_s']:.3f} s = {100 * summary['grammar_share_of_step']:.1f}% of step time, "
        f"{100 * summary['grammar_hidden']:.0f}% hidden behind the forward"
    )
    return f"{'Grammar time:':<{width}}{value}"

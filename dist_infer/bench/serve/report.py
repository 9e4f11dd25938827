"""What a bench-serve run reports: latency percentiles, throughput, goodput under SLOs, the table
on stdout, the CDF plot and the JSON.

Reads only finished RequestRecords, so the numbers can be checked on hand-made records; strict
JSON (no NaN or Infinity) so any parser reads the output.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from dist_infer.bench.serve.client import RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
LATENCY_COLUMNS = ("mean", "median", "p90", "p99", "max")


def latency_stats(values: Sequence[float]) -> dict[str, Optional[float]]:
    """mean, median, p90, p99 and max in milliseconds (None for no values, so the JSON stays valid)."""
    if len(values) == 0:
        return {key: None for key in LATENCY_COLUMNS}
    ms = np.asarray(values, dtype=float) * 1000.0
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
        "max": float(ms.max()),
    }


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request meets every given limit; with <2 tokens TPOT has no gaps to break
    it, and with no content chunk its TTFT is its E2E."""
    if not record.success:
        return False
    measured = {
        "ttft": record.ttft if record.ttft is not None else record.e2e,
        "tpot": record.tpot or 0.0,
        "e2e": record.e2e,
    }
    return all(measured[name] is not None and measured[name] <= limit for name, limit in slo.items())


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: Optional[dict[str, float]] = None
) -> dict[str, Any]:
    """Counts, throughputs, goodput and latency stats over the successful requests."""
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    errors = _error_counts([r.error for r in failed])
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "slo": dict(slo) if slo else None,
        "goodput": per_s(sum(meets_slo(r, slo) for r in done)) if slo else None,
        "ttft_ms": latency_stats([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": latency_stats([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": latency_stats([gap for r in done for gap in r.itl]),
        "e2e_ms": latency_stats([r.e2e for r in done if r.e2e is not None]),
        "errors": errors,
        **schema_validity(done),
    }
    return summary


def schema_validity(done: Sequence[RequestRecord]) -> dict[str, Any]:
    """--dataset json-schema: of the answers that ended by themselves (finish_reason stop), how many
    are instances of their schemas; the answers max_tokens cut short are counted apart. All None
    when no request had a schema."""
    checked = [r for r in done if r.schema_valid is not None]
    if not checked:
        return {"schema_answers": None, "schema_valid": None, "schema_truncated": None, "schema_validity_rate": None}
    ended = [r for r in checked if r.finish_reason != "length"]
    valid = sum(bool(r.schema_valid) for r in ended)
    return {
        "schema_answers": len(checked),
        "schema_valid": valid,
        "schema_truncated": len(checked) - len(ended),
        "schema_validity_rate": valid / len(ended) if ended else None,
        "schema_errors": _error_counts([r.schema_error for r in ended if not r.schema_valid]),
    }


def _error_counts(errors: Sequence[str], keep: int = 10) -> dict[str, int]:
    """The most frequent error texts with their counts; the rest lumped into one entry so a run
    with many distinct errors (ids in the text) keeps a small summary."""
    counts: dict[str, int] = {}
    for error in errors:
        counts[error] = counts.get(error, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: -item[1])
    kept = dict(ranked[:keep])
    if len(ranked) > keep:
        kept[f"({len(ranked) - keep} other error texts)"] = sum(count for _, count in ranked[keep:])
    return kept


def _number(value: Optional[float], digits: int = 2) -> str:
    """A table cell: "-" for a metric with no values."""
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(summary: dict[str, Any]) -> str:
    """The human-readable table printed on stdout."""
    rows = [
        ("Model", summary.get("model", "-")),
        ("Endpoint", summary.get("endpoint_url", "-")),
        ("Arrivals", summary.get("arrivals", "-")),
        ("Max concurrency", summary.get("max_concurrency") or "none"),
        ("Completed requests", summary["completed"]),
        ("Failed requests", summary["failed"]),
        ("Duration (s)", _number(summary["duration_s"])),
        ("Total input tokens", summary["total_input_tokens"]),
        ("Total output tokens", summary["total_output_tokens"]),
        ("Request throughput (req/s)", _number(summary["request_throughput"])),
        ("Output token throughput (tok/s)", _number(summary["output_throughput"])),
        ("Total token throughput (tok/s)", _number(summary["total_token_throughput"])),
    ]
    if summary.get("slo"):
        limits = ", ".join(f"{name} <= {limit:g} s" for name, limit in summary["slo"].items())
        rows.append(("Goodput (req/s)", f"{_number(summary['goodput'])}  ({limits})"))
    if summary.get("schema_answers"):
        rate = summary["schema_validity_rate"]
        rows.append(
            (
                "Schema validity",
                f"{'-' if rate is None else f'{100 * rate:.1f}%'}  ({summary['schema_valid']} valid of "
                f"{summary['schema_answers'] - summary['schema_truncated']} that ended; "
                f"{summary['schema_truncated']} cut by max_tokens)",
            )
        )
    width = max(len(label) for label, _ in rows) + 2
    lines = ["=" * 20 + " bench-serve " + "=" * 20]
    lines += [f"{label + ':':<{width}}{value}" for label, value in rows]
    lines.append(f"{'latency (ms)':<14}" + "".join(f"{key:>12}" for key in LATENCY_COLUMNS))
    for name in LATENCY_METRICS:
        stats = summary[f"{name}_ms"]
        lines.append(f"{name.upper():<14}" + "".join(f"{_number(stats.get(key)):>12}" for key in LATENCY_COLUMNS))
    lines.append("(ITL: every gap between two streamed chunks of a request, pooled over requests)")
    errors = list(summary["errors"].items())  # most frequent first
    for error, count in errors[:5]:
        lines.append(f"failed x{count}: {error[:300]}")
    for error, count in list((summary.get("schema_errors") or {}).items())[:5]:
        lines.append(f"invalid x{count}: {error[:300]}")
    if len(errors) > 5:
        lines.append(f"failed x{sum(count for _, count in errors[5:])}: other errors (see --save-results)")
    lines.append("=" * 53)
    return "\n".join(lines)


def plot_cdfs(records: Sequence[RequestRecord], path: Union[str, Path]) -> None:
    """CDFs of TTFT, TPOT, ITL and E2E (ms) in a 2x2 grid with p50 and p99 marked, as a PNG.

    Uses a bare matplotlib Figure (Agg canvas) rather than pyplot, so no global figure state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    done = [r for r in records if r.success]
    series = {
        "TTFT": [r.ttft for r in done if r.ttft is not None],
        "TPOT": [r.tpot for r in done if r.tpot is not None],
        "ITL": [gap for r in done for gap in r.itl],
        "E2E": [r.e2e for r in done if r.e2e is not None],
    }
    figure = Figure(figsize=(11, 8))
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2)
    for ax, (name, values) in zip(axes.flat, series.items()):
        ax.set_title(f"{name} ({len(values)} values)")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction <= x")
        ax.grid(True, alpha=0.3)
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ms = np.sort(np.asarray(values, dtype=float) * 1000.0)
        ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
        for q, style in ((50, "--"), (99, ":")):
            value = float(np.percentile(ms, q))
            ax.axvline(
                value, linestyle=style, color="tab:red" if q == 99 else "tab:green", label=f"p{q} {value:.2f} ms"
            )
        ax.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(str(path), format="png", dpi=100)


def finite_or_none(value: Any) -> Any:
    """JSON without NaN/Infinity (strict parsers reject them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(item) for item in value]
    return value


def write_results(path: Union[str, Path], summary: dict[str, Any], records: Sequence[RequestRecord]) -> None:
    """--save-results: the summary and every request's record (tpot included, it is a property)."""
    document = {"summary": summary, "requests": [dict(dataclasses.asdict(r), tpot=r.tpot) for r in records]}
    Path(path).write_text(json.dumps(finite_or_none(document), indent=1))

"""The server's prefix cache hit rate over a run, from its Prometheus `/metrics` scraped before and
after: hits / queries in prompt tokens.

Reads this project's `dist_infer:prefix_cache_{queries,hits}_total` or vLLM's
`vllm:prefix_cache_{queries,hits}_total`, summed over their labels (engines, instances). Anything
that goes wrong (no /metrics, a 401 or 404, no such counters, a server that restarted and so counts
from zero again) gives None rather than failing the run: the hit rate is an extra.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

from loguru import logger

METRIC_PREFIXES = ("dist_infer", "vllm")  # this project's names first, then vLLM's
SCRAPE_TIMEOUT_S = 10.0


class CacheCounters(NamedTuple):
    """Prefix cache counters at one moment, in prompt tokens."""

    queries: float
    hits: float


def sample_value(line: str, name: str) -> Optional[float]:
    """The value of one exposition line if it is a sample of `name` (any labels), else None."""
    if not line.startswith(name):
        return None
    rest = line[len(name) :]
    if rest.startswith("{"):
        end = rest.rfind("}")
        if end < 0:
            return None
        rest = rest[end + 1 :]
    elif not rest[:1].isspace():
        return None  # a longer name that starts with this one (e.g. ..._total_created)
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def counter_sums(text: str, names: dict[str, str]) -> dict[str, Optional[float]]:
    """Each of `names` (key -> metric name) in a Prometheus text exposition, summed over its labels;
    None for a name with no sample."""
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    sums: dict[str, Optional[float]] = {}
    for key, name in names.items():
        values = [v for v in (sample_value(line, name) for line in lines) if v is not None]
        sums[key] = sum(values) if values else None
    return sums


def parse_cache_counters(text: str) -> Optional[CacheCounters]:
    """The prefix cache counters of a Prometheus text exposition, each summed over its labels; the
    first of METRIC_PREFIXES that exports the queries counter wins. None if neither does."""
    for prefix in METRIC_PREFIXES:
        sums = counter_sums(text, {c: f"{prefix}:prefix_cache_{c}_total" for c in ("queries", "hits")})
        if sums["queries"] is not None:
            return CacheCounters(sums["queries"], sums["hits"] or 0.0)
    return None


async def scrape_metrics_text(client: Any, base_url: str) -> Optional[str]:
    """GET base_url/metrics with the run's client (so the same key and TLS settings): the exposition
    text, or None if the server has no /metrics or refuses it."""
    try:
        response = await client.get(base_url + "/metrics", timeout=SCRAPE_TIMEOUT_S)
        if response.status_code != 200:
            logger.debug(f"{base_url}/metrics: HTTP {response.status_code}, no server counters")
            return None
        return response.text
    except Exception as exc:  # any transport or decoding error: the counters are optional
        logger.debug(f"{base_url}/metrics unreadable ({type(exc).__name__}: {exc}), no server counters")
        return None


async def scrape_cache_counters(client: Any, base_url: str) -> Optional[CacheCounters]:
    """The prefix cache counters of base_url/metrics; None if there are none (see scrape_metrics_text)."""
    text = await scrape_metrics_text(client, base_url)
    return None if text is None else parse_cache_counters(text)


def cache_summary(before: Optional[CacheCounters], after: Optional[CacheCounters]) -> dict[str, Optional[float]]:
    """The summary's prefix cache entries: the run's query and hit tokens and their ratio; all None
    when either scrape found no counters, the counters went backwards (a restart) or nothing was
    queried."""
    empty = {"prefix_cache_hit_rate": None, "prefix_cache_queries": None, "prefix_cache_hits": None}
    if before is None or after is None:
        return empty
    queries, hits = after.queries - before.queries, after.hits - before.hits
    if queries <= 0 or hits < 0 or hits > queries:
        return empty
    return {"prefix_cache_hit_rate": hits / queries, "prefix_cache_queries": queries, "prefix_cache_hits": hits}


def cache_report_line(summary: dict[str, Any], width: int = 33) -> str:
    """The table's hit rate line, its value at column `width` like report.format_report's rows."""
    rate = summary.get("prefix_cache_hit_rate")
    if rate is None:
        value = "- (the server's /metrics has no prefix cache counters)"
    else:
        value = (
            f"{100 * rate:.1f}%  ({summary['prefix_cache_hits']:.0f} of "
            f"{summary['prefix_cache_queries']:.0f} prompt tokens)"
        )
    return f"{'Prefix cache hit rate:':<{width}}{value}"

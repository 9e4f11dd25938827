"""`dist-infer bench-serve`: a load generator for any OpenAI-compatible completion server.

The command itself: check the outputs can be written, build the requests (or the conversations of
a multi-turn run), run the load between two scrapes of the server's /metrics (for the prefix cache
hit rate), then report. Kept thin so each step lives (and is tested) in its own module; see the
package docstring.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np
from loguru import logger

from dist_infer.bench.serve.cache_metrics import (
    cache_report_line,
    cache_summary,
    parse_cache_counters,
    scrape_metrics_text,
)
from dist_infer.bench.serve.client import (
    RequestRecord,
    api_key_of,
    normalized_base_url,
    open_session,
    run_requests,
    tls_verify_of,
)
from dist_infer.bench.serve.conversations import Conversation, build_conversations, is_multiturn
from dist_infer.bench.serve.datasets import BenchRequest, build_requests, load_tokenizer_counter
from dist_infer.bench.serve.flags import ENDPOINT_PATHS, InputError, add_bench_serve_flags, parse_slo
from dist_infer.bench.serve.grammar_metrics import grammar_report_line, grammar_summary, parse_grammar_counters
from dist_infer.bench.serve.multiturn import run_conversations, ttft_by_turn, turn_report_lines
from dist_infer.bench.serve.report import finite_or_none, format_report, plot_cdfs, summarize, write_results
from dist_infer.bench.serve.speculative_metrics import (
    parse_speculative_counters,
    speculative_report_line,
    speculative_summary,
)


async def run_workload(
    args: argparse.Namespace,
    base_url: str,
    work: Union[list[BenchRequest], list[Conversation]],
    progress: Callable[[RequestRecord], None],
) -> tuple[list[RequestRecord], float, str, dict]:
    """Send the requests (or replay the conversations) between two /metrics scrapes; the records,
    the duration, the model and the summary's entries from the server's counters (the prefix
    cache hit rate, the grammar's share of step time, speculation's acceptance)."""
    async with open_session(
        base_url,
        args.model,
        args.endpoint,
        args.max_concurrency,
        args.timeout,
        api_key_of(args.api_key),
        tls_verify_of(args.insecure, args.ca_cert),
    ) as session:
        before = await scrape_metrics_text(session.client, base_url)
        session.start = time.perf_counter()
        if is_multiturn(args):
            encode = load_tokenizer_counter(args.tokenizer)[1] if args.tokenizer and args.prompt_ids else None
            records = await run_conversations(
                session, work, args.endpoint, args.ignore_eos, args.prompt_ids, args.max_input_len, progress, encode
            )
        else:
            records = await run_requests(
                session, work, args.endpoint, args.ignore_eos, progress, temperature=args.temperature
            )
        duration = session.now()
        after = await scrape_metrics_text(session.client, base_url)
    counters = {
        **cache_summary(*(parse_cache_counters(t) if t is not None else None for t in (before, after))),
        **grammar_summary(parse_grammar_counters(before), parse_grammar_counters(after)),
        **speculative_summary(parse_speculative_counters(before), parse_speculative_counters(after)),
    }
    return records, duration, session.model, counters


def report_text(summary: dict) -> str:
    """report.format_report's table with the prefix cache hit rate and (multi-turn) the per-turn
    TTFT rows added above its closing rule."""
    table = format_report(summary).split("\n")
    optional = [line for line in (grammar_report_line(summary), speculative_report_line(summary)) if line]
    extra = [cache_report_line(summary)] + optional + turn_report_lines(summary)
    return "\n".join(table[:-1] + extra + table[-1:])


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 if every request succeeded, 1 if some failed, 2 for bad input."""
    from tqdm import tqdm

    try:
        slo = parse_slo(args.slo) if isinstance(args.slo, str) else args.slo
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise InputError("--plot needs matplotlib: pip install 'dist_infer[plot]'")
        for flag, output in (("--plot", args.plot), ("--save-results", args.save_results)):
            if output and not Path(output).resolve().parent.is_dir():  # fail now, not after the whole run
                raise InputError(f"{flag} {output}: directory {Path(output).resolve().parent} does not exist")
        rng = np.random.default_rng(args.seed)
        multiturn = is_multiturn(args)
        if multiturn:
            work, arrivals = build_conversations(args, rng)
            planned = sum(len(c.turns) for c in work)
            what = f"{len(work)} conversations (at most {planned} requests)"
        else:
            work, arrivals = build_requests(args, rng)
            planned = len(work)
            what = f"{planned} requests"
        base_url = normalized_base_url(args.url)
        logger.info(f"{what} to {base_url}{ENDPOINT_PATHS[args.endpoint]}, arrivals: {arrivals}")
        with tqdm(total=planned, desc="bench-serve", unit="req", file=sys.stderr, disable=None) as bar:
            records, duration, model, cache = asyncio.run(
                run_workload(args, base_url, work, progress=lambda record: bar.update(1))
            )
    except InputError as exc:
        print(f"bench-serve: error: {exc}", file=sys.stderr)
        return 2

    summary = {
        "model": model,
        "url": base_url,
        "endpoint": args.endpoint,
        "endpoint_url": base_url + ENDPOINT_PATHS[args.endpoint],
        "dataset": args.dataset,
        "num_prompts": len(records),
        "num_conversations": len(work) if multiturn else None,
        "arrivals": arrivals,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        **summarize(records, duration, slo),
        **cache,
        **(ttft_by_turn(records) if multiturn else {"ttft_ms_by_turn": None, "completed_by_turn": None}),
    }
    summary = finite_or_none(summary)
    print(report_text(summary))
    try:
        if args.save_results:
            write_results(args.save_results, summary, records)
            logger.info(f"per-request records written to {args.save_results}")
        if args.plot:
            plot_cdfs(records, args.plot)
            logger.info(f"latency CDFs written to {args.plot}")
    except OSError as exc:
        print(f"bench-serve: error: cannot write {exc.filename or 'output'}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, allow_nan=False), flush=True)
    return 0 if summary["failed"] == 0 else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Standalone entry point (`python -m dist_infer.bench.serve.command ...`), same as the subcommand."""
    parser = argparse.ArgumentParser(prog="bench-serve", description=__doc__.splitlines()[0])
    add_bench_serve_flags(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""`dist-infer bench-serve`: a load generator for any OpenAI-compatible completion server.

The command itself: check the outputs can be written, build the requests, run the load, then
report. Kept thin so each step lives (and is tested) in its own module; see the package docstring.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from loguru import logger

from dist_infer.bench.serve.client import api_key_of, normalized_base_url, run_load, tls_verify_of
from dist_infer.bench.serve.datasets import build_requests
from dist_infer.bench.serve.flags import ENDPOINT_PATHS, InputError, add_bench_serve_flags, parse_slo
from dist_infer.bench.serve.report import finite_or_none, format_report, plot_cdfs, summarize, write_results


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
        requests, arrivals = build_requests(args, rng)
        base_url = normalized_base_url(args.url)
        logger.info(f"{len(requests)} requests to {base_url}{ENDPOINT_PATHS[args.endpoint]}, arrivals: {arrivals}")
        with tqdm(total=len(requests), desc="bench-serve", unit="req", file=sys.stderr, disable=None) as bar:
            records, duration, model = asyncio.run(run_load(
                requests, base_url, args.model, args.endpoint, args.ignore_eos, args.max_concurrency,
                args.timeout, progress=lambda record: bar.update(1), api_key=api_key_of(args.api_key),
                verify=tls_verify_of(args.insecure, args.ca_cert)))
    except InputError as exc:
        print(f"bench-serve: error: {exc}", file=sys.stderr)
        return 2

    summary = {
        "model": model,
        "url": base_url,
        "endpoint": args.endpoint,
        "endpoint_url": base_url + ENDPOINT_PATHS[args.endpoint],
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "arrivals": arrivals,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        **summarize(records, duration, slo),
    }
    summary = finite_or_none(summary)
    print(format_report(summary))
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

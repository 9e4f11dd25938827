"""`dist-infer bench` and `dist-infer bench-serve`: start the ranks (or the sweep, or the load
generator) and hand over to dist_infer.bench, which does the measuring."""

from __future__ import annotations

import argparse
from typing import Sequence

from dist_infer.cli.extras import need
from dist_infer.launch.logs import configure_logging


def cmd_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from dist_infer.bench import parse_compare, run_bench
    from dist_infer.cli.cp_auto import resolve_cp_auto
    from dist_infer.launch.rank import run_rank_command, spawn_local

    if args.sweep:
        from dist_infer.bench.sweep import run_sweep

        configure_logging("bench", args.log_level)
        return run_sweep(args, argv)
    parse_compare(args.compare)  # a typo fails here, before any rank starts
    argv = resolve_cp_auto(args, list(argv), args.prompt_len)
    code = spawn_local(args, list(argv))
    if code is not None:
        return code
    return run_rank_command(lambda: run_bench(args))


def cmd_bench_serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    need(("httpx",), "serve", "bench-serve")
    from dist_infer.bench.serve.command import run_bench_serve

    configure_logging("bench-serve", "INFO")
    return run_bench_serve(args)

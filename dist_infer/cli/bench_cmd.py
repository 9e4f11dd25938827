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
    return run_rank_command(lambda: run_bench(args, rank_start(args)))


def rank_start(args: argparse.Namespace):
    """How each bench rank joins the job, loads its shard and builds its engine: the rank start-up's
    (`launch.rank`, `launch.model_options`), handed to the bench, which imports no launch code."""
    from dist_infer.bench import RankStart
    from dist_infer.launch.model_options import build_bench_engine, load_model
    from dist_infer.launch.rank import join_job
    from dist_infer.topology import Layout

    config = Layout(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp)
    return RankStart(
        join=lambda: join_job(args.backend, config, args.timeout, args.iface, args.log_level, args.shm),
        load=lambda groups: load_model(args, groups),
        build_engine=lambda stage, groups: build_bench_engine(args, stage, groups),
    )


def cmd_bench_serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    need(("httpx",), "serve", "bench-serve")
    from dist_infer.bench.serve.command import run_bench_serve

    configure_logging("bench-serve", "INFO")
    return run_bench_serve(args)

"""`dist-infer comm-test`: run as one rank of a job, check and time every op on every group
(comm/selftest.py), and print the table (and --json) on rank 0."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def cmd_comm_test(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from dist_infer.launch.rank import join_job, run_rank_command
    from dist_infer.topology import Layout

    def body() -> int:
        from tqdm import tqdm

        from dist_infer.comm.selftest import DEFAULT_SIZES, format_table, results_json, run_comm_test

        groups = join_job(
            args.backend,
            Layout(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp),
            args.timeout,
            args.iface,
            args.log_level,
            args.shm,
        )
        world = groups.world
        bar = tqdm(desc="comm-test", unit="case", disable=None if world.rank == 0 else True, file=sys.stderr)
        results = run_comm_test(
            groups, sizes=args.sizes or DEFAULT_SIZES, iters=args.iters, progress=lambda r: bar.update(1)
        )
        bar.close()
        summary = results_json(results, world.size, world.backend)
        if world.rank == 0:
            print(f"comm-test: {world.size} ranks, backend {world.backend}, mesh {groups.mesh.describe()}")
            print(format_table(results))
            verdict = "all checks passed" if summary["ok"] else "SOME CHECKS FAILED"
            print(f"comm-test: {verdict}")
            if args.json:
                print(json.dumps(summary))
        world.barrier()
        groups.destroy()
        world.destroy()
        return 0 if summary["ok"] else 1

    return run_rank_command(body)

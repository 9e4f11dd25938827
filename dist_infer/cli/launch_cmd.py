"""`dist-infer launch`: the flags turned into a launch plan (launch/launcher.py), printed with
--dry-run or run."""

from __future__ import annotations

import argparse
from typing import Sequence

from loguru import logger

from dist_infer.launch.logs import configure_logging


def cmd_launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from dist_infer.launch.launcher import LaunchError, LaunchOptions, plan, run
    from dist_infer.topology import HostfileError, parse_hostfile

    configure_logging("launch" if args.node_rank is None else f"launch node {args.node_rank}")
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        logger.error(
            "nothing to launch: give the command after '--', e.g. dist-infer launch --nproc-per-node 2 -- dist-infer comm-test"
        )
        return 2
    try:
        hosts = parse_hostfile(args.hostfile) if args.hostfile else None
        if args.node_rank is not None and not hosts:
            raise LaunchError("--node-rank needs --hostfile")
        opts = LaunchOptions(
            command=command,
            nproc_per_node=args.nproc_per_node,
            hosts=hosts,
            hostfile=args.hostfile,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            launcher=args.launcher,
            ssh_command=args.ssh_command,
            iface=args.iface,
        )
        procs = plan(opts)
    except (HostfileError, LaunchError) as exc:
        logger.error(str(exc))
        return 2
    if args.dry_run:
        for proc in procs:
            print(proc.shell())
        return 0
    return run(procs)

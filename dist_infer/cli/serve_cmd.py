"""`dist-infer serve`: the command, and one rank of a model instance behind the API (its flags:
cli/serve_flags.py).

The API (HTTP, dispatch, migration, failover) is a process of its own that hosts no rank
(cli/serve_frontend.py). Each instance's ranks load their shard and build the engine; the
instance's first rank (its driver) connects to the front end's hub and runs the step loop as it
is told (serving/instance/join.py, serving/instance/driver_loop.py); the other ranks follow the step plans.
Every rank listens on its own KV link (comm/peer/link.py), authenticated with the cluster key, so
after start-up no instance waits on another's ranks: an instance can die, be stopped, or be
started again as a job of its own (`serve --join HOST:PORT --instance-index I`) while the others
serve on.

Under torchrun, mpirun, srun or our `launch`, the job's ranks are the instances (`--instances
"tp=2; tp=1; tp=1"`: consecutive ranges of world ranks) and world rank 0 starts the front end; SIGTERM to
it is passed on to the front end, which stops every instance in order and exits 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Sequence

from loguru import logger

from dist_infer.cli.extras import need

SWITCH_INTERVAL_S = 5e-4


def cmd_serve(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Outside any launcher (and not --join) this process is the front end, which starts every
    instance as a job of its own (cli/serve_frontend.py); otherwise it is one rank of an instance."""
    from dist_infer.launch.rank import run_rank_command, spawn_local
    from dist_infer.topology.discovery import discover

    need(("fastapi", "uvicorn", "prometheus_client", "jinja2"), "serve", "serve")
    args.argv = list(argv)  # to start an instance as a job of its own (start-up, restart, scale-up)
    # --placement slurm: the front end, also in the batch script or a one-task step of the allocation
    if args.frontend_only or (not args.join and (discover(os.environ) is None or args.placement == "slurm")):
        from dist_infer.cli.serve_frontend import run_frontend

        try:
            return run_frontend(args, list(argv))
        except ValueError as exc:
            logger.error(str(exc))
            return 2
    code = spawn_local(args, list(argv))
    if code is not None:
        return code
    return run_rank_command(lambda: run_serve(args))


def default_kv_blocks(stage, block_size: int, memory_bytes: int, max_num_seqs: int) -> int:
    """Blocks that fit `memory_bytes` on this rank, at most enough for max_num_seqs full-length requests."""
    import torch

    kv_heads = max(1, stage.kv_heads_local)
    element = torch.empty((), dtype=stage.dtype).element_size()
    per_block = max(1, len(stage.layers)) * 2 * block_size * kv_heads * stage.cfg.head_dim * element
    enough = max_num_seqs * -(-stage.cfg.max_positions // block_size)
    return max(1, min(memory_bytes // per_block, enough))


def _join(args):
    """-> (world, this rank's instance index, the instance specs, the instance's groups)."""
    from dist_infer.launch.rank import join_job, join_world
    from dist_infer.serving.fleet.instance_specs import (
        InstanceSpec,
        check_roles,
        check_world,
        join_instance,
        parse_instances,
    )
    from dist_infer.topology import Layout

    if args.join:
        if args.instance_index is None or args.instance_index < 0:
            raise ValueError("--join needs --instance-index (which instance this job is)")
        specs = parse_instances(args.instances or "1", args.tp, args.pp)
        if len(specs) != 1:
            raise ValueError(
                f"--join: --instances {args.instances!r} names {len(specs)} instances; a joining job is one"
            )
        spec = specs[0]
        groups = join_job(
            args.backend,
            Layout(tp=spec.tp, pp=spec.pp, ep=args.ep, cp=args.cp),
            args.timeout,
            args.iface,
            args.log_level,
            args.shm,
        )
        return groups.world, args.instance_index, specs, groups
    if not args.instances:
        groups = join_job(
            args.backend,
            Layout(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp),
            args.timeout,
            args.iface,
            args.log_level,
            args.shm,
        )
        return groups.world, 0, [InstanceSpec(args.tp, args.pp)], groups
    if args.ep > 1 or args.cp > 1:
        raise ValueError(
            f"--instances takes tp and pp layouts; --ep {args.ep} --cp {args.cp} are not supported with it"
        )
    specs = parse_instances(args.instances, args.tp, args.pp)
    check_roles(specs)
    world, _, _ = join_world(
        args.backend, args.timeout, args.iface, args.log_level, check=lambda n: check_world(specs, n)
    )
    index, groups = join_instance(world, specs, args.shm)
    if world.rank == 0:
        logger.info(f"{len(specs)} instances: " + ", ".join(f"{i}: {s.describe()}" for i, s in enumerate(specs)))
    return world, index, specs, groups


def run_serve(args) -> int:
    """One rank of one instance (the front end is another process: cli/serve_frontend.py)."""
    world, index, specs, groups = _join(args)
    # A serving process runs its step loop beside threads that relay requests, outputs and migration
    # calls; hand the GIL over more often than every 5 ms so a relayed message does not wait out a
    # compute thread's time slice (it cut a live migration's downtime markedly where cores are few).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    frontend, address, key = _reach_frontend(args, world)
    if frontend is not None:
        _forward_stop_signals(frontend)  # from now on: a Ctrl-C during the load reaches the front end too
    try:
        _serve_as_rank(args, world, index, specs, groups, address, key, frontend is None and not args.join)
    except BaseException:
        if frontend is not None and frontend.poll() is None:
            frontend.terminate()  # in its own session: it would otherwise wait for instances that never come
        raise
    return _frontend_exit_code(frontend)


def _serve_as_rank(args, world, index: int, specs, groups, address: tuple, key: bytes, quiet: bool) -> None:
    """Load this rank's shard, build the engine, and serve: the driver over the hub's connection,
    the others following its step plans. `quiet`: stop signals are the front end's to act on."""
    import torch

    from dist_infer.launch.model_options import build_engine, load_model, scheduler_options
    from dist_infer.serving.fleet.wire import Hello
    from dist_infer.serving.instance.join import block_bytes, open_kv_link, run_instance

    driver = groups.world.rank == 0
    stage, report, _ = load_model(args, groups)  # token ids only: the front end holds the tokenizer
    options = scheduler_options(args)
    if options["num_blocks"] is None:  # every rank of an instance uses the same count: the smallest that fits on all
        mine = default_kv_blocks(stage, args.block_size, args.kv_cache_memory, args.max_num_seqs)
        blocks = torch.tensor([mine], dtype=torch.long)
        groups.world.all_reduce(blocks, "min")
        options["num_blocks"] = int(blocks[0])
    engine = build_engine(args, stage, groups, heartbeat_s=min(2.0, args.timeout / 4), **options)
    logger.info(
        f"instance {index}: loaded layers {report.layers[0]}..{report.layers[1] - 1} in {report.load_s:.2f} s; "
        f"KV cache {engine.num_blocks} blocks of {args.block_size} tokens"
    )
    pids = torch.empty(groups.world.size, dtype=torch.long)
    groups.world.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.long))
    link, addresses = open_kv_link(engine, groups, address[0], key, args.cp, args.migration_timeout)
    if quiet:  # a rank of a launched job other than world rank 0: the front end stops the job in order
        _ignore_stop_signals("the front end")
    if not driver:
        _ignore_stop_signals("the instance's driver")
        engine.follow()
    else:
        spec = specs[0] if args.join else specs[index]
        hello = Hello.from_fields(
            index=index,
            layout=spec.layout,
            role=spec.role,
            tp=spec.tp,
            pp=spec.pp,
            pids=pids.tolist(),
            addresses=addresses,
            total_blocks=engine.num_blocks,
            block_size=args.block_size,
            cp=args.cp,
            max_positions=stage.cfg.max_positions,
            vocab_size=stage.cfg.vocab_size,
            block_bytes=block_bytes(stage, args.block_size),
        )
        run_instance(engine, index, address, key, hello)
    if link is not None:
        engine.mover.close()
        link.close()
    engine.close()
    groups.destroy()
    if groups.world is not world:
        groups.world.destroy()
    world.destroy()


def _reach_frontend(args, world):
    """-> (the front-end process this rank started, or None; the hub's address; the cluster key).
    A --join job reads the hub from its flags; in a launched job world rank 0 starts the front end
    and tells every rank where it listens (a collective)."""
    import secrets

    from dist_infer.serving.instance.join import hub_host, hub_to_join, share_hub_address
    from dist_infer.serving.placement.spawn import start_frontend_child

    if args.join:
        address, key = hub_to_join(args.join, args.hub_key_file)
        return None, address, key
    process = address = key = None
    if world.rank == 0:
        key = secrets.token_hex(16).encode()
        process, address = start_frontend_child(
            getattr(args, "argv", None) or ["serve"], hub_host(), key, max(60.0, args.timeout)
        )
    address, key = share_hub_address(world, address, key)
    return process, address, key


def _frontend_exit_code(frontend) -> int:
    """World rank 0 of a launched job ends with the front end's code. Its own instance may have
    stopped (drained, or stopped by an operator) while the others serve on, so it waits for the
    front end as long as it runs; its stop signals still go there."""
    return 0 if frontend is None else frontend.wait()


def _forward_stop_signals(frontend) -> None:
    """World rank 0's SIGTERM/SIGINT go to the front end, which stops the instances in order."""

    def forward(signum, _):
        logger.info(f"{signal.Signals(signum).name}: passed on to the front end (pid {frontend.pid})")
        if frontend.poll() is None:
            frontend.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)


def _ignore_stop_signals(who: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # the front end shuts the job down in order and tells us
        signal.signal(sig, lambda signum, _: logger.info(f"{signal.Signals(signum).name}: waiting for {who} to stop"))

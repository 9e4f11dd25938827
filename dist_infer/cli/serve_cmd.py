"""`dist-infer serve`: the flags, the command, and one rank of a model instance behind the API.

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

from dist_infer.arg_types import port_number, positive_int, positive_size
from dist_infer.cli.extras import need
from dist_infer.serving.placement.spawn import HUB_KEY_ENV

KV_CACHE_MEMORY_DEFAULT = "1G"
SWITCH_INTERVAL_S = 5e-4


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    from dist_infer.cli.http_flags import add_http_flags
    from dist_infer.launch.model_options import add_model_flags, add_scheduler_flags

    add_model_flags(p)
    add_scheduler_flags(p, offline=False)
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default %(default)s)")
    p.add_argument("--port", type=port_number, default=8000, help="HTTP port (default %(default)s; 0: a free one, logged)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the checkpoint directory's name)")
    p.add_argument("--kv-cache-memory", type=positive_size, default=KV_CACHE_MEMORY_DEFAULT,
                   help="memory per rank for the KV cache when --kv-blocks is not given, e.g. 512M, 2G "
                        "(default %(default)s)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="requests that may wait for admission; past it new requests get HTTP 503 with Retry-After "
                        "(default %(default)s)")
    p.add_argument("--instances", default=None,
                   help="several model instances in one job, each with its own ranks and step loop, behind one API: "
                        "a count of --tp x --pp instances (--instances 3), or one layout per instance, separated by "
                        "';' or spaces, each optionally with a role (--instances \"prefill:tp=2,pp=2; decode:tp=1\"; "
                        "the compact tp2,tp1,tp2pp2 also reads). The job needs the sum of their sizes in ranks. "
                        "Default: one instance over all ranks")
    p.add_argument("--dispatch", choices=("prefix", "load", "rr", "queue"), default="prefix",
                   help="which instance a new request goes to: prefix (default): where the prompt's prefix is cached, "
                        "weighed against load (prefill blocks left to compute + KV blocks active after it, as NVIDIA "
                        "Dynamo's KV router; plain load when no instance holds any of it), load (Llumnix's freeness: "
                        "free KV blocks left after the queued demand, per request), rr (round robin), queue "
                        "(shortest queue)")
    p.add_argument("--migrate-interval", type=float, default=1.0,
                   help="seconds between the migration controller's rounds, which move live requests from the most "
                        "to the least loaded instance (0: only forced or drain migrations; default %(default)s)")
    p.add_argument("--migration-timeout", type=float, default=30.0,
                   help="seconds an instance may take to answer a migration step before the migration is given up "
                        "(the request stays on its source; default %(default)s)")
    p.add_argument("--ready-file", default=None,
                   help="write {host, port, pid, hub} as JSON to this file once the API accepts requests (for scripts)")
    p.add_argument("--join", default=None, metavar="HOST:PORT",
                   help="run no API: join a running server's instances as instance --instance-index (a restart, or "
                        "one more instance), at the hub address it logs and writes to --ready-file. The key comes "
                        f"from ${HUB_KEY_ENV} or --hub-key-file. --instances gives this job's one layout")
    p.add_argument("--instance-index", type=int, default=None,
                   help="with --join: which instance this job is (a dead or stopped one's index restarts it; the next "
                        "free index adds one)")
    p.add_argument("--hub-key-file", default=None,
                   help="the key instances join with: the API writes it here (mode 600), --join reads it")
    p.add_argument("--max-request-failovers", type=int, default=1,
                   help="times a request may be taken over after the instance running it died; a request whose "
                        "instances died more often is failed with an error, not dispatched again, so a request "
                        "that crashes instances cannot walk through the fleet (counted in "
                        "dist_infer:requests_quarantined_total; default %(default)s)")
    add_fleet_flags(p)
    p.add_argument("--frontend-only", action="store_true",
                   help="internal: run only the API and wait for the job's instances to join (world rank 0 of a "
                        "torchrun/mpirun/srun job starts it so; the key comes from $" + HUB_KEY_ENV + ")")
    p.add_argument("--hub-host", default=None,
                   help="the address the API's hub listens on for instance drivers (default 127.0.0.1; world rank 0 "
                        "of a launched job passes the address facing its rendezvous host; --placement slurm: the one facing "
                        "the allocation's other nodes). Instances on other hosts "
                        "need an address they reach")
    add_http_flags(p)


def add_fleet_flags(p: argparse.ArgumentParser) -> None:
    """How big the fleet may grow and where its instances run: bounds, placement, restarts, autoscaling."""
    p.add_argument("--max-instances", type=int, default=16,
                   help="the most instances the server may have, dead and stopped ones included: POST "
                        "/admin/instances beyond it gets HTTP 409 (default %(default)s)")
    p.add_argument("--max-ranks", type=positive_int, default=None, metavar="N",
                   help="the most ranks the server's instances may run at once, those starting included: instances "
                        "at start-up, POST /admin/instances, a restart (an operator's or --auto-restart's) or an "
                        "--autoscale scale-up whose layout would pass it is refused before any process starts "
                        "(HTTP 400, or 409 when it would fit once other instances stop). Default: what the placement "
                        "has: this host's usable cores (local), the Ray cluster's CPUs over --ray-cpus-per-rank (its "
                        "GPUs with --device cuda), the Slurm allocation's CPUs over --cpus-per-task")
    p.add_argument("--placement", choices=("local", "ray", "slurm"), default="local",
                   help="where the front end starts its instances (at start, restart, scale-up): local (jobs of "
                        "their own on this host), ray (each instance a Ray placement group of one bundle per "
                        "rank packed on one node, wherever the cluster has room; its node in /admin/instances; "
                        "needs pip install 'dist_infer[ray]') or slurm (inside an allocation, sbatch or salloc: "
                        "each instance a job step, srun --nodes 1 --ntasks N --exact, on a node with room; the front "
                        "end stays where serve runs, its hub on the address facing the allocation's other nodes) "
                        "(default %(default)s)")
    p.add_argument("--ray-address", default="auto", metavar="auto|HOST:PORT",
                   help="--placement ray: the Ray cluster to join (auto: the one running on this host)")
    p.add_argument("--ray-cpus-per-rank", type=int, default=1,
                   help="--placement ray: CPUs each rank's bundle reserves (and its threads) (default %(default)s)")
    p.add_argument("--auto-restart", choices=("auto", "on", "off"), default="auto",
                   help="start a dead instance again (placed anew: under Ray on any node with room), up to 3 times "
                        "before it serves again; auto: on under --placement ray, else off (default %(default)s)")
    p.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="grow and shrink the fleet between MIN and MAX instances to --slo: one more (a stopped one "
                        "restarted, else a new one of the first instance's layout) when the p90 TTFT or time per "
                        "output token of the last 10 s (only first tokens since the last decision) passes the SLO, or a "
                        "request has waited longer than the TTFT SLO for its first token, or the prompts queued at the "
                        "least backlogged instance predict a longer wait; one fewer, drained by live migration so no "
                        "request is dropped, when everything stayed under half the SLO with nothing queued and at most two running "
                        "requests per instance left for --autoscale-down-after seconds. Without --instances, the "
                        "server starts MIN instances")
    p.add_argument("--slo", default=None, metavar="ttft=S,tpot=S",
                   help="--autoscale's targets in seconds: TTFT and/or time per output token (e.g. ttft=2,tpot=0.1)")
    p.add_argument("--autoscale-cooldown", type=float, default=10.0,
                   help="seconds after a scaling decision before the next (the flap guard; default %(default)s)")
    p.add_argument("--autoscale-window", type=float, default=10.0,
                   help="seconds of TTFTs and token gaps the p90s are taken over (default %(default)s)")
    p.add_argument("--autoscale-down-after", type=float, default=15.0,
                   help="seconds the fleet must stay under half the SLO before one instance is removed "
                        "(default %(default)s)")


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
            raise ValueError(f"--join: --instances {args.instances!r} names {len(specs)} instances; a joining job is one")
        spec = specs[0]
        groups = join_job(args.backend, Layout(tp=spec.tp, pp=spec.pp, ep=args.ep, cp=args.cp),
                          args.timeout, args.iface, args.log_level, args.shm)
        return groups.world, args.instance_index, specs, groups
    if not args.instances:
        groups = join_job(args.backend, Layout(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp),
                          args.timeout, args.iface, args.log_level, args.shm)
        return groups.world, 0, [InstanceSpec(args.tp, args.pp)], groups
    if args.ep > 1 or args.cp > 1:
        raise ValueError(f"--instances takes tp and pp layouts; --ep {args.ep} --cp {args.cp} are not supported with it")
    specs = parse_instances(args.instances, args.tp, args.pp)
    check_roles(specs)
    world, _, _ = join_world(args.backend, args.timeout, args.iface, args.log_level, check=lambda n: check_world(specs, n))
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
    logger.info(f"instance {index}: loaded layers {report.layers[0]}..{report.layers[1] - 1} in {report.load_s:.2f} s; "
                f"KV cache {engine.num_blocks} blocks of {args.block_size} tokens")
    pids = torch.empty(groups.world.size, dtype=torch.long)
    groups.world.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.long))
    link, addresses = open_kv_link(engine, groups, address[0], key, args.cp, args.migration_timeout)
    if quiet:  # a rank of a launched job other than world rank 0: the front end stops the job in order
        _ignore_stop_signals("the API process")
    if not driver:
        _ignore_stop_signals("the instance's driver")
        engine.follow()
    else:
        spec = specs[0] if args.join else specs[index]
        hello = Hello.from_fields(index=index, layout=spec.layout, role=spec.role, tp=spec.tp, pp=spec.pp,
                                  pids=pids.tolist(), addresses=addresses, total_blocks=engine.num_blocks,
                                  block_size=args.block_size, cp=args.cp, max_positions=stage.cfg.max_positions,
                                  vocab_size=stage.cfg.vocab_size, block_bytes=block_bytes(stage, args.block_size))
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
        process, address = start_frontend_child(getattr(args, "argv", None) or ["serve"], hub_host(), key,
                                                max(60.0, args.timeout))
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
        logger.info(f"{signal.Signals(signum).name}: passed on to the API process (pid {frontend.pid})")
        if frontend.poll() is None:
            frontend.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)


def _ignore_stop_signals(who: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # the API process shuts the job down in order and tells us
        signal.signal(sig, lambda signum, _: logger.info(f"{signal.Signals(signum).name}: waiting for {who} to stop"))

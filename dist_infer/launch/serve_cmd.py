"""`dist-infer serve`: the flags, and one rank of a model instance behind the API.

The API (HTTP, dispatch, migration, failover) is a process of its own that hosts no rank
(launch/serve_frontend.py). Each instance's ranks load their shard and build the engine; the
instance's first rank (its driver) connects to the front end's hub and runs the step loop as it
is told (serving/instance_server.py); the other ranks follow the step plans. Every rank listens
on its own KV link (comm/peer_link.py), authenticated with the cluster key, so after start-up no
instance waits on another's ranks: an instance can die, be stopped, or be started again as a job
of its own (`serve --join HOST:PORT --instance-index I`) while the others serve on.

Under torchrun, mpirun, srun or our `launch`, the job's ranks are the instances (`--instances
tp2,tp1,tp1`: consecutive ranges of world ranks) and world rank 0 starts the front end; SIGTERM to
it is passed on to the front end, which stops every instance in order and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from loguru import logger

from dist_infer.launch.serve_frontend import HUB_KEY_ENV

KV_CACHE_MEMORY_DEFAULT = "1G"
HUB_CONNECT_TRIES = 6
SWITCH_INTERVAL_S = 5e-4


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    from dist_infer.launch.cli import parse_size
    from dist_infer.launch.model_options import add_model_flags, add_scheduler_flags

    add_model_flags(p)
    add_scheduler_flags(p, offline=False)
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default %(default)s; 0: a free one, logged)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the checkpoint directory's name)")
    p.add_argument("--kv-cache-memory", type=parse_size, default=KV_CACHE_MEMORY_DEFAULT,
                   help="memory per rank for the KV cache when --kv-blocks is not given, e.g. 512M, 2G "
                        "(default %(default)s)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="requests that may wait for admission; past it new requests get HTTP 503 with Retry-After "
                        "(default %(default)s)")
    p.add_argument("--instances", default=None,
                   help="several model instances in one job, each with its own ranks and step loop, behind one API: "
                        "a count of --tp x --pp instances (--instances 3), or one layout per instance "
                        "(--instances tp2,tp1,tp1; tpNppM). The job needs the sum of their sizes in ranks. "
                        "Default: one instance over all ranks")
    p.add_argument("--dispatch", choices=("load", "rr", "queue"), default="load",
                   help="which instance a new request goes to: load (Llumnix's freeness: free KV blocks left after "
                        "the queued demand, per request; default), rr (round robin), queue (shortest queue)")
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
    p.add_argument("--max-instances", type=int, default=16,
                   help="the most instances the server may have, dead and stopped ones included: POST "
                        "/admin/instances beyond it gets HTTP 409 (default %(default)s)")
    p.add_argument("--frontend-only", action="store_true",
                   help="internal: run only the API and wait for the job's instances to join (world rank 0 of a "
                        "torchrun/mpirun/srun job starts it so; the key comes from $" + HUB_KEY_ENV + ")")
    p.add_argument("--hub-host", default=None,
                   help="the address the API's hub listens on for instance drivers (default 127.0.0.1; world rank 0 "
                        "of a launched job passes the address facing its rendezvous host). Instances on other hosts "
                        "need an address they reach")
    from dist_infer.launch.http_flags import add_http_flags

    add_http_flags(p)


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
    from dist_infer.serving.instances import InstanceSpec, check_roles, check_world, join_instance, parse_instances
    from dist_infer.topology import ParallelConfig

    if args.join:
        if args.instance_index is None or args.instance_index < 0:
            raise ValueError("--join needs --instance-index (which instance this job is)")
        specs = parse_instances(args.instances or "1", args.tp, args.pp)
        if len(specs) != 1:
            raise ValueError(f"--join: --instances {args.instances!r} names {len(specs)} instances; a joining job is one")
        spec = specs[0]
        groups = join_job(args.backend, ParallelConfig(tp=spec.tp, pp=spec.pp, ep=args.ep, cp=args.cp),
                          args.timeout, args.iface, args.log_level, args.shm)
        return groups.world, args.instance_index, specs, groups
    if not args.instances:
        groups = join_job(args.backend, ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp),
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


def _hub_to_join(args) -> tuple[tuple, bytes]:
    host, _, port = (args.join or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--join {args.join!r}: expected HOST:PORT (the hub address the server logs)")
    key = os.environ.get(HUB_KEY_ENV)
    if not key and args.hub_key_file:
        key = Path(args.hub_key_file).read_text().strip()
    if not key:
        raise ValueError(f"--join: the hub's key is neither in ${HUB_KEY_ENV} nor in a --hub-key-file")
    return (host, int(port)), key.encode()


def _share_hub_address(world, address: Optional[tuple], key: Optional[bytes]) -> tuple[tuple, bytes]:
    """World rank 0's API address and connection key, to every rank (a collective)."""
    import torch

    buf = torch.zeros(512, dtype=torch.uint8)
    if address is not None:
        raw = json.dumps({"host": address[0], "port": address[1], "key": key.decode()}).encode()
        buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    if world.size > 1:
        world.broadcast(buf, 0)
    info = json.loads(bytes(buf[buf != 0].tolist()).decode())
    return (info["host"], info["port"]), info["key"].encode()


def _hub_host() -> str:
    """The address the instances' drivers reach world rank 0 at: the one facing the rendezvous host."""
    from dist_infer.topology.network import local_address_towards

    master = os.environ.get("MASTER_ADDR")
    if not master or master in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    return local_address_towards(master)


def run_serve(args) -> int:
    """One rank of one instance (the front end is another process: launch/serve_frontend.py)."""
    world, index, specs, groups = _join(args)
    # A serving process runs its step loop beside threads that relay requests, outputs and migration
    # calls; hand the GIL over more often than every 5 ms so a relayed message does not wait out a
    # compute thread's time slice (halved a live migration's downtime on the 2-core CPU machine).
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

    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.launch.model_options import build_engine, load_model, scheduler_options
    from dist_infer.models.gguf_checkpoint import shared_parses

    driver = groups.world.rank == 0
    tokenizer = None
    with shared_parses():  # a GGUF's weights and tokenizer share one parse of the file, dropped after
        stage, report, model = load_model(args, groups)
        if driver:
            try:
                tokenizer = TextTokenizer(model)
            except Exception as exc:  # noqa: BLE001 - token-id prompts still work
                logger.warning(f"no tokenizer ({exc}); only token-id prompts will be accepted")
    options = scheduler_options(args)
    if options["num_blocks"] is None:  # every rank of an instance uses the same count: the smallest that fits on all
        mine = default_kv_blocks(stage, args.block_size, args.kv_cache_memory, args.max_num_seqs)
        blocks = torch.tensor([mine], dtype=torch.long)
        groups.world.all_reduce(blocks, "min")
        options["num_blocks"] = int(blocks[0])
    engine = build_engine(args, stage, groups, tokenizer=tokenizer, heartbeat_s=min(2.0, args.timeout / 4), **options)
    logger.info(f"instance {index}: loaded layers {report.layers[0]}..{report.layers[1] - 1} in {report.load_s:.2f} s; "
                f"KV cache {engine.num_blocks} blocks of {args.block_size} tokens")
    pids = torch.empty(groups.world.size, dtype=torch.long)
    groups.world.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.long))
    link, addresses = _open_kv_link(args, engine, groups, address[0], key)
    if quiet:  # a rank of a launched job other than world rank 0: the front end stops the job in order
        _ignore_stop_signals("the API process")
    if not driver:
        _ignore_stop_signals("the instance's driver")
        engine.follow()
    else:
        spec = specs[0] if args.join else specs[index]
        from dist_infer.serving.wire import Hello

        hello = Hello.from_fields(index=index, layout=spec.layout, role=spec.role, tp=spec.tp, pp=spec.pp,
                                  pids=pids.tolist(), addresses=addresses, total_blocks=engine.num_blocks,
                                  block_size=args.block_size, cp=args.cp, max_positions=stage.cfg.max_positions,
                                  vocab_size=stage.cfg.vocab_size, block_bytes=_block_bytes(stage, args.block_size))
        _run_instance(engine, index, address, key, hello)
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

    from dist_infer.launch.serve_frontend import start_frontend_child

    if args.join:
        address, key = _hub_to_join(args)
        return None, address, key
    process = address = key = None
    if world.rank == 0:
        key = secrets.token_hex(16).encode()
        process, address = start_frontend_child(getattr(args, "argv", None) or ["serve"], _hub_host(), key,
                                                max(60.0, args.timeout))
    address, key = _share_hub_address(world, address, key)
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


def _open_kv_link(args, engine, groups, hub_host: str, key: bytes):
    """Every rank: listen for migrating KV blocks on the address facing the API's host, learn the
    instance's other ranks' addresses (a collective over the instance), and take part in
    migrations. -> (the link, every rank's address); (None, []) for context-parallel instances."""
    import torch

    from dist_infer.comm.peer_link import PeerLink
    from dist_infer.engine.kv_transfer import int_to_ip, ip_to_int
    from dist_infer.topology.network import local_address_towards

    if args.cp > 1:
        return None, []
    host = "127.0.0.1" if hub_host in ("127.0.0.1", "localhost") else local_address_towards(hub_host)
    link = PeerLink(host, timeout=args.migration_timeout, key=key)
    mine = torch.tensor([ip_to_int(link.address[0]), link.address[1]], dtype=torch.long)
    every = torch.empty(2 * groups.world.size, dtype=torch.long)
    groups.world.all_gather(every, mine)
    v = every.tolist()
    addresses = [(int_to_ip(v[2 * r]), v[2 * r + 1]) for r in range(groups.world.size)]
    engine.enable_migration(link, addresses)
    return link, addresses


def _block_bytes(stage, block_size: int) -> int:
    """Bytes of one KV block over the whole model (all layers, all KV heads): what a migration moves."""
    import torch

    cfg = stage.cfg
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=stage.dtype).element_size()


def _ignore_stop_signals(who: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # the API process shuts the job down in order and tells us
        signal.signal(sig, lambda signum, _: logger.info(f"{signal.Signals(signum).name}: waiting for {who} to stop"))


def _run_instance(engine, index: int, address: tuple, key: bytes, hello) -> None:
    from multiprocessing.connection import Client

    from dist_infer.serving.hub import no_delay
    from dist_infer.serving.instance_server import InstanceServer

    for attempt in range(HUB_CONNECT_TRIES):  # a hub whose handshake slots are all taken closes at accept
        try:
            conn = Client(address, authkey=key)
            break
        except (OSError, EOFError) as exc:
            if attempt == HUB_CONNECT_TRIES - 1:
                raise ConnectionError(f"instance {index}: could not join the API's hub at {address[0]}:{address[1]} "
                                      f"in {HUB_CONNECT_TRIES} tries ({type(exc).__name__}: {exc})") from None
            time.sleep(0.5 * (attempt + 1))
    InstanceServer(engine, index, no_delay(conn)).run(hello)

"""`dist-infer serve`: the model over the job's ranks behind an OpenAI-compatible HTTP API.

The job's ranks form one model instance, or several with `--instances tp2,tp1,tp1` (each its own
ranks, layout and step loop; `prefill:`/`decode:` roles split the two phases). World rank 0 hosts
the API (serving/cluster.py): it dispatches each request to an instance, owns every client's
stream, and moves live requests between instances. Each instance's first rank drives its step
loop (serving/instance_server.py); the other ranks follow the step plans. Every rank listens on
its own KV link (comm/peer_link.py), so after start-up no instance waits on another's ranks.

The API also listens for instances that join later: `serve --join HOST:PORT --instance-index I`
starts one as a job of its own (the API does this itself to restart a dead or stopped instance,
or to add one). On SIGTERM the server stops accepting, lets running requests finish (or aborts
them after a grace period), tells every instance to stop, and exits 0. If an instance fails, its
requests go on on the others; when none is left, the server exits non-zero with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from loguru import logger

KV_CACHE_MEMORY_DEFAULT = "1G"
SWITCH_INTERVAL_S = 5e-4
HUB_KEY_ENV = "DIST_INFER_HUB_KEY"  # the API's connection key, for instances that join it
# flags of the API process that an instance started as a job of its own does not take
API_ONLY_FLAGS = ("--instances", "--host", "--port", "--ready-file", "--nproc", "--dispatch", "--migrate-interval",
                  "--migration-timeout", "--max-queue", "--served-model-name", "--join", "--instance-index",
                  "--hub-key-file", "--backend", "--hostfile")


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


def default_kv_blocks(stage, block_size: int, memory_bytes: int, max_num_seqs: int) -> int:
    """Blocks that fit `memory_bytes` on this rank, at most enough for max_num_seqs full-length requests."""
    import torch

    kv_heads = max(1, stage.kv_heads_local)
    element = torch.empty((), dtype=stage.dtype).element_size()
    per_block = max(1, len(stage.layers)) * 2 * block_size * kv_heads * stage.cfg.head_dim * element
    enough = max_num_seqs * -(-stage.cfg.max_positions // block_size)
    return max(1, min(memory_bytes // per_block, enough))


def served_name(flag: Optional[str], model: str) -> str:
    """The model id clients see: a built-in model's name, else the checkpoint's folder or file name."""
    from dist_infer.models.builtin import NAMES, model_name

    name = model_name(flag)
    return name if name in NAMES else Path(model).name


def chat_template_of(model: str, tokenizer=None) -> Optional[str]:
    """The chat template: the tokenizer's own (a GGUF's metadata), or tokenizer_config.json's
    chat_template (a string, or the 'default' one of a list), if any."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    path = Path(model) / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, json.JSONDecodeError):
        return None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


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
        world, _, _ = join_world(args.backend, args.timeout, args.iface, args.log_level,
                                 check=lambda n: check_world(specs, n))
        _, groups = join_instance(world, specs, args.shm)
        return world, args.instance_index, specs, groups
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


def instance_argv(argv: list[str], index: int, spec, hub: tuple, drop=API_ONLY_FLAGS) -> list[str]:
    """The command line of a job that runs instance `index` alone and joins the hub: the serve
    command's own model and engine flags, without the API's (pure; unit tested)."""
    from dist_infer.launch.launcher import strip_flag

    args = list(argv[argv.index("serve") + 1:] if "serve" in argv else argv)
    for flag in drop:
        args = strip_flag(args, flag)
    return ["serve", *args, "--instances", spec.describe(), "--join", f"{hub[0]}:{hub[1]}",
            "--instance-index", str(index)]


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
    import torch

    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.launch.model_options import build_engine, load_model, scheduler_options
    from dist_infer.models.gguf_checkpoint import shared_parses

    world, index, specs, groups = _join(args)
    # A serving process runs its step loop beside threads that relay requests, outputs and migration
    # calls; hand the GIL over more often than every 5 ms so a relayed message does not wait out a
    # compute thread's time slice (halved a live migration's downtime on the 2-core CPU machine).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    driver = groups.world.rank == 0
    api = world.rank == 0 and not args.join
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
    listener = key = None
    if args.join:
        address, key = _hub_to_join(args)
    else:
        if api:
            import secrets
            from multiprocessing.connection import Listener

            key = secrets.token_hex(16).encode()
            listener = Listener((_hub_host(), 0), authkey=key)
        address, key = _share_hub_address(world, listener.address if listener else None, key)
    link, addresses = _open_kv_link(args, engine, groups, address[0])
    code = 0
    if not driver:
        _ignore_stop_signals("the instance's driver")
        engine.follow()
    else:
        spec = specs[0] if args.join else specs[index]
        hello = {"index": index, "layout": spec.layout, "role": spec.role, "tp": spec.tp, "pp": spec.pp,
                 "pids": pids.tolist(), "addresses": addresses,
                 "total_blocks": engine.num_blocks, "block_size": args.block_size, "cp": args.cp,
                 "max_positions": stage.cfg.max_positions, "vocab_size": stage.cfg.vocab_size,
                 "block_bytes": _block_bytes(stage, args.block_size)}
        if api:
            code = _serve_api(args, engine, hello, listener, address, key, len(specs), model, tokenizer)
        else:
            if not args.join:  # a job of its own (--join) stops on its launcher's signal; its requests go on elsewhere
                _ignore_stop_signals("the API process")
            _run_instance(engine, index, address, key, hello)
    if link is not None:
        engine.mover.close()
        link.close()
    engine.close()
    groups.destroy()
    if groups.world is not world:
        groups.world.destroy()
    world.destroy()
    return code


def _open_kv_link(args, engine, groups, hub_host: str):
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
    link = PeerLink(host, timeout=args.migration_timeout)
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


def _run_instance(engine, index: int, address: tuple, key: bytes, hello: dict) -> None:
    from multiprocessing.connection import Client

    from dist_infer.serving.instance_server import InstanceServer, no_delay

    InstanceServer(engine, index, no_delay(Client(address, authkey=key))).run(hello)


def _read_hello(conn, timeout: float) -> dict:
    """A driver's first message, its hello; a clear error if it says nothing or something else."""
    if not conn.poll(timeout):
        raise TimeoutError(f"an instance driver connected but said nothing for {timeout:g} s")
    kind, hello = conn.recv()
    if kind != "hello":
        raise ValueError(f"an instance driver sent {kind!r} first, not hello")
    return hello


def _accept_instances(listener, count: int, timeout: float) -> list:
    """The drivers' connections, in instance order (each says hello first)."""
    import threading

    from dist_infer.serving.instance_server import no_delay

    conns: dict[int, tuple] = {}
    failure: list[BaseException] = []

    def accept() -> None:
        try:
            while len(conns) < count:
                conn = no_delay(listener.accept())
                hello = _read_hello(conn, timeout)
                conns[hello["index"]] = (conn, hello)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)

    t = threading.Thread(target=accept, name="accept-instances", daemon=True)
    t.start()
    t.join(timeout)
    if failure:
        raise failure[0]
    if len(conns) < count:
        missing = sorted(set(range(count)) - set(conns))
        raise TimeoutError(f"instances {missing} did not connect to the API process within {timeout:g} s")
    return [conns[i] for i in range(count)]


def _accept_more(listener, cluster) -> None:
    """After start-up the hub keeps listening: restarted and added instances join through it."""
    from dist_infer.serving.instance_server import no_delay

    while True:
        try:
            conn = no_delay(listener.accept())
        except OSError:
            return  # closed: the server is stopping
        except Exception as exc:  # noqa: BLE001 - a bad key, a port scan: refused, logged
            logger.warning(f"hub: a connection was refused ({type(exc).__name__}: {exc})")
            continue
        try:
            hello = _read_hello(conn, 30.0)
        except Exception as exc:  # noqa: BLE001 - that driver is refused; the hub listens on
            logger.warning(f"hub: {exc}")
            conn.close()
            continue
        cluster.attach(conn, hello)


def _spawner(args, hub: tuple, key: bytes):
    """Start instance i as a job of its own on this host (our launcher, its own world), joining the hub."""
    import subprocess

    from dist_infer.topology.discovery import without_launcher_env

    def spawn(index: int, spec):
        argv = instance_argv(getattr(args, "argv", None) or ["serve"], index, spec, hub)
        env = without_launcher_env(os.environ)
        env[HUB_KEY_ENV] = key.decode()
        command = [sys.executable, "-m", "dist_infer", *argv]
        logger.info(f"instance {index}: {' '.join(command)}")
        # its own session: a Ctrl-C at the terminal reaches the API, which stops the instances in order
        return subprocess.Popen(command, env=env, start_new_session=True)

    return spawn


def _serve_api(args, engine, hello: dict, listener, address: tuple, key: bytes, count: int, model: str,
               tokenizer) -> int:
    import threading

    from dist_infer.serving.api_server import build_app, serve_http
    from dist_infer.serving.cluster import Cluster, InstanceClient

    local = threading.Thread(target=_run_instance, args=(engine, 0, address, key, hello), name="instance-0", daemon=True)
    local.start()
    clients = [InstanceClient(i, conn, h) for i, (conn, h) in enumerate(_accept_instances(listener, count, args.timeout))]
    name = args.served_model_name or served_name(args.model, model)
    if args.hub_key_file:
        path = Path(args.hub_key_file)
        path.touch(mode=0o600)
        path.write_text(key.decode())

    def on_dead(reason: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the HTTP server shuts down; the exit code says why

    cluster = Cluster(clients, name, tokenizer, chat_template_of(model, tokenizer), args.max_queue, args.dispatch,
                      args.migrate_interval, migration_timeout=args.migration_timeout, on_dead=on_dead,
                      spawner=_spawner(args, address, key), join_timeout_s=max(60.0, args.timeout))
    cluster.start()
    threading.Thread(target=_accept_more, args=(listener, cluster), name="hub-accept", daemon=True).start()
    app = build_app(cluster, name)

    def ready(host: str, port: int) -> None:
        layouts = ", ".join(c.spec.describe() for c in clients)
        logger.info(f"serving {name!r} on http://{host}:{port}/v1 with {count} instance(s) [{layouts}] "
                    f"(max {args.max_num_seqs} running, {args.max_batched_tokens} tokens per step each); "
                    f"instances join at {address[0]}:{address[1]}")
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps({"host": host, "port": port, "pid": os.getpid(),
                                                         "hub": [address[0], address[1]]}))

    serve_http(app, args.host, args.port, on_ready=ready)
    cluster.stop()
    listener.close()
    local.join(60)
    if cluster.dead_reason is not None:
        logger.error(f"the server stopped because an instance failed: {cluster.dead_reason}")
        return 1
    logger.info("server stopped")
    return 0

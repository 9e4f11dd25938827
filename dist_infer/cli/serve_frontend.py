"""The serving front end: the HTTP API and the cluster (dispatch, migration, failover), and no model.

It is a process of its own that hosts no engine rank (as vLLM v1 keeps its API server apart from
EngineCore): every instance, a single one included, is its own processes whose driver connects
to this process's hub (serving/fleet/hub.py, serving/instance/join.py). Killing any rank of any instance
therefore ends at most that instance; its requests go on on the others, and the API answers
throughout.

Two ways it starts (serving/placement/spawn.py starts the processes):
- `dist-infer serve` outside any launcher: this process is the front end and starts each
  instance as a job of its own (`serve --join`, our launcher for its ranks), the same way it
  restarts a dead instance or adds one.
- under torchrun, mpirun, srun or our `launch`: the job's ranks are the instances, and world rank
  0 starts the front end as a child process (`serve --frontend-only`), which waits for the job's
  instance drivers to join instead of starting them.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from loguru import logger

from dist_infer.serving.placement.spawn import HUB_KEY_ENV, LocalSpawner, write_hub_file

if TYPE_CHECKING:
    from dist_infer.serving.placement.rank_budget import RankBudget


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


def _tokenizer_and_template(model: str):
    from dist_infer.engine.tokenizer import TextTokenizer

    try:
        tokenizer = TextTokenizer(model)
    except Exception as exc:  # noqa: BLE001 - token-id prompts still work
        logger.warning(f"no tokenizer ({exc}); only token-id prompts will be accepted")
        tokenizer = None
    return tokenizer, chat_template_of(model, tokenizer)


def run_frontend(args, argv: list[str]) -> int:
    """Serve the API until SIGTERM (exit 0) or until no instance is left (exit 1)."""
    from dist_infer.cli.http_flags import http_options_of
    from dist_infer.launch.logs import configure_logging
    from dist_infer.launch.model_options import model_path
    from dist_infer.serving.fleet.hub import Hub, StartupWaiter
    from dist_infer.serving.fleet.instance_specs import check_roles, parse_instances

    configure_logging("api", args.log_level)
    scale = autoscale_bounds(args)
    specs = parse_instances(
        args.instances or str(scale[0] if scale else 1), args.tp, args.pp, max_ranks=getattr(args, "max_ranks", None)
    )
    check_roles(specs)
    if len(specs) > 1 and (args.ep > 1 or args.cp > 1):
        raise ValueError(
            f"--instances takes tp and pp layouts; --ep {args.ep} --cp {args.cp} are not supported with it"
        )
    guard = http_options_of(args)  # a bad flag is an error now, not after every instance has loaded
    model = model_path(args)
    key = os.environ.get(HUB_KEY_ENV, "").encode() if args.frontend_only else secrets.token_hex(16).encode()
    if not key:
        raise ValueError(f"--frontend-only: no key in ${HUB_KEY_ENV}")
    hub = Hub(args.hub_host or _default_hub_host(args), key)
    waiter = StartupWaiter(len(specs))
    hub.start(waiter.on_hello)
    try:
        spawn = _spawner_for(args, argv, hub.address, key, specs)
        rank_capacity = rank_capacity_for(args, spawn, specs)  # a fleet past --max-ranks: nothing has started
    except BaseException:
        hub.close()
        raise
    if args.frontend_only:
        write_hub_file(hub.address)
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    processes: dict = {}
    try:
        if not args.frontend_only:
            processes.update({i: spawn(i, spec) for i, spec in enumerate(specs)})
        tokenizer, template = _tokenizer_and_template(model)
        joined = waiter.wait(max(60.0, args.timeout), failed=lambda: _start_failure(processes, stopping))
    except BaseException as exc:
        logger.error(
            f"{exc}; stopping" if isinstance(exc, (TimeoutError, RuntimeError)) else f"start-up failed: {exc!r}"
        )
        _end(processes)
        hub.close()
        if isinstance(exc, (TimeoutError, RuntimeError)):
            return 1
        raise
    try:
        return _serve(
            args,
            guard,
            joined,
            processes,
            hub,
            waiter,
            spawn,
            rank_capacity,
            served_name_for(args, model),
            tokenizer,
            template,
            stopping,
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _spawner_for(args, argv: list[str], hub: tuple, key: bytes, specs):
    """What starts instance i: a local job of its own, a Ray placement group (serving/placement/ray_placement.py)
    or a Slurm job step (serving/placement/slurm_placement.py)."""
    if getattr(args, "placement", "local") == "slurm":
        from dist_infer.serving.placement.slurm_placement import SlurmSpawner

        return SlurmSpawner(argv, hub, key)
    if getattr(args, "placement", "local") == "ray":
        from dist_infer.serving.placement.ray_placement import RaySpawner, connect

        connect(args.ray_address)
        return RaySpawner(
            argv,
            hub,
            key,
            cpus_per_rank=args.ray_cpus_per_rank,
            gpus_per_rank=1 if getattr(args, "device", "auto") == "cuda" else 0,
        )
    ranks = sum(spec.size for spec in specs)
    bounds = autoscale_bounds(args)
    if bounds is not None:  # each instance gets the cores of its slot in the largest fleet, not of the first one
        ranks = max(ranks, bounds[1] * max(spec.size for spec in specs))
    return LocalSpawner(argv, hub, key, local_ranks=ranks)


def rank_capacity_for(args, spawn, specs) -> Callable[[], "RankBudget"]:
    """What the cluster asks for the rank budget at each start: --max-ranks, else the placement's
    capacity (asked anew: a Ray cluster grows). The start-up instances must fit it before any starts
    (a launched job's, --frontend-only, run already)."""
    from dist_infer.serving.placement.rank_budget import RankBudget

    fixed = RankBudget(args.max_ranks) if getattr(args, "max_ranks", None) else None
    capacity = (lambda: fixed) if fixed is not None else spawn.rank_capacity
    budget = capacity()
    if not args.frontend_only:
        budget.check(f"--instances {'; '.join(s.describe() for s in specs)!r}", sum(s.size for s in specs))
    bounds = autoscale_bounds(args)
    if bounds is not None and bounds[1] * specs[0].size > budget.limit:
        logger.warning(
            f"--autoscale up to {bounds[1]} instances of {specs[0].describe()} would take "
            f"{bounds[1] * specs[0].size} ranks; {budget.describe()}: the fleet stops growing there"
        )
    logger.info(f"rank budget: {budget.describe()}")
    return capacity


def autoscale_bounds(args) -> Optional[tuple[int, int]]:
    """--autoscale's (MIN, MAX), checked with --slo and --max-instances before anything starts."""
    from dist_infer.serving.placement.autoscale_policy import parse_autoscale, parse_slo

    if not getattr(args, "autoscale", None):
        if getattr(args, "slo", None):
            raise ValueError("--slo is --autoscale's target: give --autoscale MIN:MAX too")
        return None
    bounds = parse_autoscale(args.autoscale)
    if not args.slo:
        raise ValueError("--autoscale needs --slo ttft=S and/or tpot=S: the latency it scales to")
    parse_slo(args.slo)
    if bounds[1] > args.max_instances:
        raise ValueError(f"--autoscale {args.autoscale}: MAX is more than --max-instances {args.max_instances}")
    return bounds


def _autoscaler(args, cluster):
    from dist_infer.serving.placement.autoscale_policy import AutoscalePolicy, parse_autoscale, parse_slo
    from dist_infer.serving.placement.autoscaler import Autoscaler

    lo, hi = parse_autoscale(args.autoscale)
    policy = AutoscalePolicy(
        lo, hi, parse_slo(args.slo), cooldown_s=args.autoscale_cooldown, low_for_s=args.autoscale_down_after
    )
    logger.info(f"autoscaling between {lo} and {hi} instances to the SLO {policy.slo.describe()}")
    cluster.latency.window_s = args.autoscale_window
    return Autoscaler(cluster, policy, cluster.instances[0].spec.describe())


def _default_hub_host(args) -> str:
    """127.0.0.1, or under --placement slurm the address the allocation's other nodes reach."""
    if getattr(args, "placement", "local") == "slurm":
        from dist_infer.serving.placement.slurm_placement import hub_host

        return hub_host(os.environ)
    return "127.0.0.1"


def served_name_for(args, model: str) -> str:
    return args.served_model_name or served_name(args.model, model)


def _start_failure(processes: dict, stopping: threading.Event) -> Optional[str]:
    if stopping.is_set():
        return "a stop signal came while the instances were starting"
    for index, process in processes.items():
        code = process.poll()
        if code is not None:
            return f"instance {index}'s job exited with code {code} before it joined"
    return None


def _end(processes: dict) -> None:
    for process in processes.values():
        if process.poll() is None:
            process.terminate()
    for process in processes.values():
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def write_private(path: str, text: str) -> None:
    """Write a secret readable by its owner only, also over a file that existed with a wider mode
    (open's mode applies only to a file it creates)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


def _serve(
    args,
    guard,
    joined,
    processes: dict,
    hub,
    waiter,
    spawn,
    rank_capacity,
    name: str,
    tokenizer,
    template,
    stopping: threading.Event,
) -> int:
    from dist_infer.serving.fleet.cluster import Cluster, FleetConfig, InstanceClient
    from dist_infer.serving.http.api_server import build_app, serve_http
    from dist_infer.serving.http.state import StructuredOptions

    clients = [InstanceClient(i, conn, hello) for i, (conn, hello) in enumerate(joined)]
    for index, process in processes.items():
        clients[index].process = process
    if args.hub_key_file:
        write_private(args.hub_key_file, hub.key.decode())

    def on_dead(reason: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the HTTP server shuts down; the exit code says why

    config = FleetConfig(
        max_queue=args.max_queue,
        dispatch=args.dispatch,
        migrate_interval=args.migrate_interval,
        migration_timeout=args.migration_timeout,
        join_timeout_s=max(60.0, args.timeout),
        max_request_failovers=args.max_request_failovers,
        kv_mirror=args.kv_mirror,
        kv_mirror_fraction=args.kv_mirror_fraction,
        max_instances=args.max_instances,
        auto_restart=args.auto_restart == "on" or (args.auto_restart == "auto" and args.placement == "ray"),
    )
    cluster = Cluster(
        clients, name, tokenizer, template, config, on_dead=on_dead, spawner=spawn, rank_capacity=rank_capacity
    )
    if args.autoscale:
        cluster.autoscaler = _autoscaler(args, cluster)
    cluster.start()
    try:
        waiter.hand_over(cluster.attach)
        structured = StructuredOptions(args.tool_call_parser, args.max_grammar_compile_s)
        app = build_app(cluster, name, guard, warm_workers=True, structured=structured)

        def ready(host: str, port: int) -> None:
            layouts = ", ".join(c.spec.describe() for c in clients)
            logger.info(
                f"serving {name!r} on {'https' if guard.tls else 'http'}://{host}:{port}/v1 with "
                f"{len(clients)} instance(s) [{layouts}] (max {args.max_num_seqs} running, "
                f"{args.max_batched_tokens} tokens per step each); instances join at "
                f"{hub.address[0]}:{hub.address[1]}"
            )
            if args.ready_file:
                Path(args.ready_file).write_text(
                    json.dumps(
                        {"host": host, "port": port, "pid": os.getpid(), "hub": [hub.address[0], hub.address[1]]}
                    )
                )

        if not stopping.is_set():  # a stop signal before uvicorn took the signals over: no server at all
            serve_http(app, args.host, args.port, on_ready=ready, guard=guard)
    finally:
        cluster.stop()
        hub.close()
    if cluster.dead_reason is not None:
        logger.error(f"the server stopped because no instance is left: {cluster.dead_reason}")
        return 1
    logger.info("server stopped")
    return 0

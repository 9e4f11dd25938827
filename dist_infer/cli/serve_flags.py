"""The flags of `dist-infer serve`: the model and scheduler's (launch/model_options.py), the API's,
the fleet's (its instances, where they run, how it grows) and the HTTP front end's protection
(cli/http_flags.py). The command that reads them is cli/serve_cmd.py.
"""

from __future__ import annotations

import argparse
from typing import Optional

from dist_infer.arg_types import fraction, port_number, positive_float, positive_int, positive_size
from dist_infer.serving.http.tool_call_parsing import PARSERS
from dist_infer.serving.placement.spawn import HUB_KEY_ENV

KV_CACHE_MEMORY_DEFAULT = "1G"


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of `dist-infer serve` but the rank's own (cli/parser.py), in the order --help lists them."""
    from dist_infer.cli.http_flags import add_http_flags
    from dist_infer.launch.model_options import add_model_flags, add_scheduler_flags

    add_model_flags(p)
    add_scheduler_flags(p, offline=False)
    _add_api_flags(p)
    _add_capacity_flags(p)
    _add_instance_flags(p)
    _add_join_flags(p)
    _add_failover_flags(p)
    add_fleet_flags(p)
    _add_frontend_flags(p)
    add_http_flags(p)


def _add_api_flags(p: argparse.ArgumentParser) -> None:
    """Where the HTTP API listens and the model name it answers to."""
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default %(default)s)")
    p.add_argument(
        "--port", type=port_number, default=8000, help="HTTP port (default %(default)s; 0: a free one, logged)"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and /v1/models lists (default: the checkpoint directory's name)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default="hermes",
        help="how a chat reply's tool calls are written when the model chooses them (tool_choice auto): "
        "hermes, <tool_call>{...}</tool_call> blocks (Hermes, Qwen, and the generic tool prompt for "
        "templates without tools); llama3_json, JSON objects separated by ';' (Llama 3.1+). "
        "required and named tool choices are forced by a grammar whatever this says (default %(default)s)",
    )
    p.add_argument(
        "--max-grammar-compile-s",
        type=positive_float,
        default=10.0,
        help="a structured-output request whose grammar (JSON schema, regex, grammar, tools) takes longer "
        "than this to check against the vocabulary is refused with a 400, and so is that spec from then "
        "on (default %(default)s; each grammar's size and work per token are bounded as well)",
    )


def _add_capacity_flags(p: argparse.ArgumentParser) -> None:
    """How much each instance holds: its KV cache, and the requests that may wait for admission."""
    p.add_argument(
        "--kv-cache-memory",
        type=positive_size,
        default=KV_CACHE_MEMORY_DEFAULT,
        help="memory per rank for the KV cache when --kv-blocks is not given, e.g. 512M, 2G (default %(default)s)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=1024,
        help="requests that may wait for admission; past it new requests get HTTP 503 with Retry-After "
        "(default %(default)s)",
    )


def _add_instance_flags(p: argparse.ArgumentParser) -> None:
    """The instances of one job, which one a new request goes to, and how live requests move between them."""
    p.add_argument(
        "--instances",
        default=None,
        help="several model instances in one job, each with its own ranks and step loop, behind one API: "
        "a count of --tp x --pp instances (--instances 3), or one layout per instance, separated by "
        "';' or spaces, each optionally with a role (--instances \"prefill:tp=2,pp=2; decode:tp=1\"; "
        "the compact tp2,tp1,tp2pp2 also reads). The job needs the sum of their sizes in ranks. "
        "Default: one instance over all ranks",
    )
    p.add_argument(
        "--dispatch",
        choices=("prefix", "load", "rr", "queue"),
        default="prefix",
        help="which instance a new request goes to: prefix (default): where the prompt's prefix is cached, "
        "weighed against load (prefill blocks left to compute + KV blocks active after it, as NVIDIA "
        "Dynamo's KV router; plain load when no instance holds any of it), load (Llumnix's freeness: "
        "free KV blocks left after the queued demand, per request), rr (round robin), queue "
        "(shortest queue)",
    )
    p.add_argument(
        "--migrate-interval",
        type=float,
        default=1.0,
        help="seconds between the migration controller's rounds, which move live requests from the most "
        "to the least loaded instance (0: only forced or drain migrations; default %(default)s)",
    )
    p.add_argument(
        "--migration-timeout",
        type=float,
        default=30.0,
        help="seconds an instance may take to answer a migration step before the migration is given up "
        "(the request stays on its source; default %(default)s)",
    )


def _add_join_flags(p: argparse.ArgumentParser) -> None:
    """How a job of its own finds a running server (its ready file, its hub's key) and joins it as an
    instance."""
    p.add_argument(
        "--ready-file",
        default=None,
        help="write {host, port, pid, hub} as JSON to this file once the API accepts requests (for scripts)",
    )
    p.add_argument(
        "--join",
        default=None,
        metavar="HOST:PORT",
        help="run no API: join a running server's instances as instance --instance-index (a restart, or "
        "one more instance), at the hub address it logs and writes to --ready-file. The key comes "
        f"from ${HUB_KEY_ENV} or --hub-key-file. --instances gives this job's one layout",
    )
    p.add_argument(
        "--instance-index",
        type=int,
        default=None,
        help="with --join: which instance this job is (a dead or stopped one's index restarts it; the next "
        "free index adds one)",
    )
    p.add_argument(
        "--hub-key-file",
        default=None,
        help="the key instances join with: the API writes it here (mode 600), --join reads it",
    )


def _add_failover_flags(p: argparse.ArgumentParser) -> None:
    """How often a request may outlive its instance: bounded, so a request that crashes instances
    cannot walk through the fleet."""
    p.add_argument(
        "--max-request-failovers",
        type=int,
        default=1,
        help="times a request may be taken over after the instance running it died; a request whose "
        "instances died more often is failed with an error, not dispatched again, so a request "
        "that crashes instances cannot walk through the fleet (counted in "
        "dist_infer:requests_quarantined_total; default %(default)s)",
    )
    p.add_argument(
        "--kv-mirror",
        choices=("off", "buddy"),
        default="off",
        help="buddy: every instance copies its running requests' KV blocks, as they fill, into another "
        "instance's prefix cache (its buddy, on another node where there is one; /admin/instances shows "
        "the pairs), beside its steps; when an instance dies its requests go on at their buddy, "
        "recomputing only the blocks not yet copied instead of their whole context. Needs prefix "
        "caching (default %(default)s)",
    )
    p.add_argument(
        "--kv-mirror-fraction",
        type=fraction,
        default=0.5,
        help="the share of an instance's KV blocks its buddies' mirrors may hold; mirrored blocks are "
        "also the first taken back when its own requests need room (default %(default)s)",
    )


def kv_mirror_flags_error(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the KV mirror flags together with the rest, or None."""
    if getattr(args, "kv_mirror", "off") == "buddy" and getattr(args, "prefix_caching", "on") == "off":
        return "--kv-mirror buddy needs prefix caching: mirrored blocks are found by their hashes (drop --prefix-caching off)"
    return None


def _add_frontend_flags(p: argparse.ArgumentParser) -> None:
    """The front end of a launched job (torchrun, mpirun, srun), which world rank 0 starts, and its hub."""
    p.add_argument(
        "--frontend-only",
        action="store_true",
        help="internal: run only the API and wait for the job's instances to join (world rank 0 of a "
        "torchrun/mpirun/srun job starts it so; the key comes from $" + HUB_KEY_ENV + ")",
    )
    p.add_argument(
        "--hub-host",
        default=None,
        help="the address the API's hub listens on for instance drivers (default 127.0.0.1; world rank 0 "
        "of a launched job passes the address facing its rendezvous host; --placement slurm: the one facing "
        "the allocation's other nodes). Instances on other hosts "
        "need an address they reach",
    )


def add_fleet_flags(p: argparse.ArgumentParser) -> None:
    """How big the fleet may grow and where its instances run: bounds, placement, restarts, autoscaling."""
    p.add_argument(
        "--max-instances",
        type=int,
        default=16,
        help="the most instances the server may have, dead and stopped ones included: POST "
        "/admin/instances beyond it gets HTTP 409 (default %(default)s)",
    )
    p.add_argument(
        "--max-ranks",
        type=positive_int,
        default=None,
        metavar="N",
        help="the most ranks the server's instances may run at once, those starting included: instances "
        "at start-up, POST /admin/instances, a restart (an operator's or --auto-restart's) or an "
        "--autoscale scale-up whose layout would pass it is refused before any process starts "
        "(HTTP 400, or 409 when it would fit once other instances stop). Default: what the placement "
        "has: this host's usable cores (local), the Ray cluster's CPUs over --ray-cpus-per-rank (its "
        "GPUs with --device cuda), the Slurm allocation's CPUs over --cpus-per-task",
    )
    p.add_argument(
        "--placement",
        choices=("local", "ray", "slurm"),
        default="local",
        help="where the front end starts its instances (at start, restart, scale-up): local (jobs of "
        "their own on this host), ray (each instance a Ray placement group of one bundle per "
        "rank packed on one node, wherever the cluster has room; its node in /admin/instances; "
        "needs pip install 'dist_infer[ray]') or slurm (inside an allocation, sbatch or salloc: "
        "each instance a job step, srun --nodes 1 --ntasks N --exact, on a node with room; the front "
        "end stays where serve runs, its hub on the address facing the allocation's other nodes) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--ray-address",
        default="auto",
        metavar="auto|HOST:PORT",
        help="--placement ray: the Ray cluster to join (auto: the one running on this host)",
    )
    p.add_argument(
        "--ray-cpus-per-rank",
        type=int,
        default=1,
        help="--placement ray: CPUs each rank's bundle reserves (and its threads) (default %(default)s)",
    )
    p.add_argument(
        "--auto-restart",
        choices=("auto", "on", "off"),
        default="auto",
        help="start a dead instance again (placed anew: under Ray on any node with room), up to 3 times "
        "before it serves again; auto: on under --placement ray, else off (default %(default)s)",
    )
    p.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="grow and shrink the fleet between MIN and MAX instances to --slo: one more (a stopped one "
        "restarted, else a new one of the first instance's layout) when the p90 TTFT or time per "
        "output token of the last 10 s (only first tokens since the last decision) passes the SLO, or a "
        "request has waited longer than the TTFT SLO for its first token, or the prompts queued at the "
        "least backlogged instance predict a longer wait; one fewer, drained by live migration so no "
        "request is dropped, when everything stayed under half the SLO with nothing queued and at most two running "
        "requests per instance left for --autoscale-down-after seconds. Without --instances, the "
        "server starts MIN instances",
    )
    p.add_argument(
        "--slo",
        default=None,
        metavar="ttft=S,tpot=S",
        help="--autoscale's targets in seconds: TTFT and/or time per output token (e.g. ttft=2,tpot=0.1)",
    )
    p.add_argument(
        "--autoscale-cooldown",
        type=float,
        default=10.0,
        help="seconds after a scaling decision before the next (the flap guard; default %(default)s)",
    )
    p.add_argument(
        "--autoscale-window",
        type=float,
        default=10.0,
        help="seconds of TTFTs and token gaps the p90s are taken over (default %(default)s)",
    )
    p.add_argument(
        "--autoscale-down-after",
        type=float,
        default=15.0,
        help="seconds the fleet must stay under half the SLO before one instance is removed (default %(default)s)",
    )

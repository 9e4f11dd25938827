"""`dist-infer launch`: start the ranks of a job and stop them all if one dies.

Three ways to start a job:
- local ranks on this node (no hostfile, or a hostfile with --node-rank K: run once per node,
  like DeepSpeed's --no_ssh), watched by this process;
- torchrun or mpirun doing the starting (--launcher torchrun|mpirun);
- every node of a hostfile started from here through ssh (or --ssh-command), each node running
  `dist-infer launch --node-rank K` itself.
The plan is computed by pure functions (`plan_*`) so --dry-run and the tests see exactly what
would run.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from loguru import logger

from dist_infer.arg_types import strip_flag
from dist_infer.launch.forked_start import RankForker, RankStartError, own_command_args, start_method
from dist_infer.topology.cores import threads_per_rank
from dist_infer.topology.discovery import DEFAULT_MASTER_PORT, free_port
from dist_infer.topology.hostfile import Host, node_rank_offsets
from dist_infer.topology.network import set_socket_interface
from dist_infer.topology.processes import ChildProcess, die_with_parent, stop_process_groups


class LaunchError(ValueError):
    """A launch that cannot be planned (node rank outside the hostfile, unequal slots for torchrun)."""


@dataclass
class Proc:
    """One process to start: a label for messages, its argv and the environment it adds."""

    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


@dataclass
class LaunchOptions:
    command: list[str]
    nproc_per_node: int = 1
    hosts: Optional[list[Host]] = None
    hostfile: Optional[str] = None
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    launcher: str = "local"
    ssh_command: str = "ssh"
    iface: Optional[str] = None


def rank_env(
    rank: int, world: int, local_rank: int, local_world: int, node_rank: int, addr: str, port: int
) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


def _node(opts: LaunchOptions) -> tuple[int, int, int, int]:
    """(ranks on this node, first global rank here, world size, node count)."""
    if not opts.hosts:
        return opts.nproc_per_node, 0, opts.nproc_per_node, 1
    k = opts.node_rank
    if k is None or not 0 <= k < len(opts.hosts):
        raise LaunchError(
            f"--node-rank {k} is outside the hostfile's {len(opts.hosts)} hosts (0..{len(opts.hosts) - 1})"
        )
    offsets = node_rank_offsets(opts.hosts)
    return opts.hosts[k].slots, offsets[k], sum(h.slots for h in opts.hosts), len(opts.hosts)


def plan_local(opts: LaunchOptions, port: int) -> list[Proc]:
    """One process per local rank, with torchrun-style variables."""
    nlocal, first, world, _ = _node(opts)
    addr = opts.master_addr or (opts.hosts[0].name if opts.hosts else "127.0.0.1")
    node_rank = opts.node_rank or 0
    threads = str(threads_per_rank(nlocal))
    procs = []
    for local in range(nlocal):
        env = rank_env(first + local, world, local, nlocal, node_rank, addr, port)
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = threads
        procs.append(Proc(f"rank {first + local}", list(opts.command), env))
    return procs


def plan_torchrun(opts: LaunchOptions, port: int) -> list[Proc]:
    nlocal, _, world, nnodes = _node(opts)
    if opts.hosts and len({h.slots for h in opts.hosts}) > 1:
        raise LaunchError(
            "torchrun needs the same number of ranks on every node; the hostfile has slots "
            + ", ".join(f"{h.name}={h.slots}" for h in opts.hosts)
            + "; use --launcher local or mpirun"
        )
    addr = opts.master_addr or (opts.hosts[0].name if opts.hosts else "127.0.0.1")
    argv = [
        shutil.which("torchrun") or "torchrun",
        f"--nnodes={nnodes}",
        f"--node-rank={opts.node_rank or 0}",
        f"--nproc-per-node={nlocal}",
        f"--master-addr={addr}",
        f"--master-port={port}",
        "--no-python",
        *opts.command,
    ]
    return [Proc(f"torchrun node {opts.node_rank or 0}", argv)]


def mpirun_base_args(np_: int) -> list[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise LaunchError("mpirun not found on PATH; install it with: pip install 'dist_infer[mpi]'")
    args = [mpirun, "-np", str(np_)]
    if os.geteuid() == 0:
        args += ["--allow-run-as-root"]
    args += ["--oversubscribe"]
    return args


def plan_mpirun(opts: LaunchOptions) -> list[Proc]:
    if opts.hosts and opts.node_rank is not None:
        raise LaunchError("--launcher mpirun starts every node itself; drop --node-rank")
    world = sum(h.slots for h in opts.hosts) if opts.hosts else opts.nproc_per_node
    argv = mpirun_base_args(world)
    if opts.hosts:
        argv += ["--host", ",".join(f"{h.name}:{h.slots}" for h in opts.hosts)]
    if opts.master_addr:
        argv += ["-x", f"MASTER_ADDR={opts.master_addr}"]
    if opts.master_port:
        argv += ["-x", f"MASTER_PORT={opts.master_port}"]
    return [Proc("mpirun", argv + list(opts.command))]


def plan_ssh(opts: LaunchOptions, port: int) -> list[Proc]:
    """One `dist-infer launch --node-rank K` per host, started through ssh (or --ssh-command)."""
    if not opts.hosts or opts.hostfile is None:
        raise LaunchError("starting every node through ssh needs a hostfile (--hostfile) and its hosts")
    addr = opts.master_addr or opts.hosts[0].name
    procs = []
    for k, host in enumerate(opts.hosts):
        remote = [
            sys.executable,
            "-m",
            "dist_infer",
            "launch",
            "--hostfile",
            os.path.abspath(opts.hostfile),
            "--node-rank",
            str(k),
            "--master-addr",
            addr,
            "--master-port",
            str(port),
            "--launcher",
            opts.launcher,
        ]
        if opts.iface:
            remote += ["--iface", opts.iface]
        remote += ["--", *opts.command]
        script = f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(remote)}"
        procs.append(Proc(f"node {k} ({host.name})", [*shlex.split(opts.ssh_command), host.name, script]))
    return procs


def plan(opts: LaunchOptions) -> list[Proc]:
    if opts.launcher == "mpirun":
        return plan_mpirun(opts)
    multi_node_fanout = bool(opts.hosts) and opts.node_rank is None
    if opts.master_port:
        port = opts.master_port
    elif opts.hosts:
        port = DEFAULT_MASTER_PORT  # every node must agree without talking: a fixed default
    else:
        port = free_port()
    if multi_node_fanout:
        return plan_ssh(opts, port)
    if opts.launcher == "torchrun":
        return plan_torchrun(opts, port)
    if opts.launcher != "local":
        raise LaunchError(f"unknown launcher {opts.launcher!r}; expected local, torchrun or mpirun")
    procs = plan_local(opts, port)
    if opts.hosts and len(opts.hosts) > 1 or opts.iface:
        iface_env: dict[str, str] = {}
        chosen = set_socket_interface(iface_env, procs[0].env["MASTER_ADDR"], opts.iface)
        if chosen:
            logger.info(f"using network interface {chosen} (reaches master {procs[0].env['MASTER_ADDR']})")
        for p in procs:
            p.env.update(iface_env)
    return procs


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _stop(children: Sequence[tuple[Proc, ChildProcess]]) -> None:
    stop_process_groups([p for _, p in children])


def _signal_all(children: Sequence[tuple[Proc, ChildProcess]], signum: int) -> None:
    for _, child in children:
        if child.poll() is None:
            try:
                os.killpg(child.pid, signum)
            except ProcessLookupError:
                pass


def _start(proc: Proc, forker: Optional[RankForker]) -> ChildProcess:
    """Start one process in its own session (signals go to its group) that dies with this launcher:
    forked from here when it runs this package and fork is safe (forked_start.py), else by exec."""
    args = own_command_args(proc.argv) if forker is not None else None
    if forker is not None and args is not None and forker.ready():
        return forker.fork(args, proc.env)
    env = {**os.environ, **proc.env}
    return subprocess.Popen(proc.argv, env=env, start_new_session=True, preexec_fn=die_with_parent)


def run(procs: Sequence[Proc], poll_s: float = 0.05, shutdown_grace_s: float = 30.0) -> int:
    """Start `procs`, wait for all; the first that fails stops the others (a job's ranks share a
    communicator, so the rest cannot go on without it). Returns the exit code.

    SIGINT/SIGTERM is passed on to every rank, which may shut down in order (a server finishes
    its requests and stops its followers); ranks still running `shutdown_grace_s` later, or
    at a second signal, are killed. All ranks exiting 0 after the signal is a clean exit (0).
    """
    children: list[tuple[Proc, ChildProcess]] = []
    interrupted: list[int] = []
    try:
        forker = RankForker() if start_method() == "fork" else None
    except RankStartError as exc:
        logger.error(f"{exc}; no rank was started")
        return 2

    def forward(signum, _frame):
        interrupted.append(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for proc in procs:
            try:
                child = _start(proc, forker)
            except OSError as exc:
                logger.error(f"{proc.label}: cannot start {proc.argv[0]!r}: {exc.strerror or exc}")
                _stop(children)
                return 127
            children.append((proc, child))
        remaining = list(children)
        forwarded, deadline = 0, None
        while remaining:
            if len(interrupted) > forwarded:
                signum = interrupted[forwarded]
                forwarded = len(interrupted)
                if deadline is not None:  # a second signal: no more waiting
                    logger.warning(
                        f"received {signal.Signals(signum).name} again: stopping {len(remaining)} process(es)"
                    )
                    _stop(children)
                    return 128 + signum
                logger.warning(
                    f"received {signal.Signals(signum).name}: passed on to {len(remaining)} process(es), "
                    f"waiting up to {shutdown_grace_s:.0f} s for them to stop"
                )
                _signal_all(remaining, signum)
                deadline = time.monotonic() + shutdown_grace_s
            if deadline is not None and time.monotonic() > deadline:
                logger.error(
                    f"{', '.join(p.label for p, _ in remaining)} still running {shutdown_grace_s:.0f} s "
                    f"after {signal.Signals(interrupted[0]).name}: killing"
                )
                _stop(children)
                return 128 + interrupted[0]
            for proc, child in list(remaining):
                code = child.poll()
                if code is None:
                    continue
                remaining.remove((proc, child))
                if code != 0:
                    others = [p.label for p, c in remaining]
                    logger.error(
                        f"{proc.label} (pid {child.pid}) failed with {describe_exit(code)}; "
                        f"stopping {len(others)} other process(es)" + (f": {', '.join(others)}" if others else "")
                    )
                    _stop(children)
                    return code if code > 0 else 128 - code
            time.sleep(poll_s)
        return 0
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def relaunch_as_local_ranks(argv: Sequence[str], nproc: int) -> int:
    """Run `python -m dist_infer ARGV` (minus --nproc) as `nproc` local ranks; their exit code."""
    command = [sys.executable, "-m", "dist_infer", *strip_flag(argv, "--nproc")]
    return run(plan(LaunchOptions(command=command, nproc_per_node=nproc)))

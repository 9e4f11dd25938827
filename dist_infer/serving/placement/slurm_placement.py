"""Instances placed by Slurm (`serve --placement slurm`, inside an allocation): each instance one job
step (`srun --nodes 1 --ntasks N --exact ... serve --join`), wherever the allocation has room; its
ranks discover themselves from the step's SLURM_* variables (topology/discovery.py: the step's first
node and a port of its own) and its driver joins the front end's hub. The front end stays where
`serve` was started (the batch script, or an salloc shell).

What the cluster sees of an instance is the srun process, a `SlurmStep` (subprocess.Popen with the
node the step runs on): srun ends when the step does, and SIGTERM or SIGKILL to srun ends the step's
tasks too, so restart, stop and scale-up work as with a local job.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from typing import Mapping, Optional

from loguru import logger

from dist_infer.serving.placement.rank_budget import RankBudget, local_capacity, slurm_capacity
from dist_infer.serving.placement.spawn import HUB_FILE_ENV, HUB_KEY_ENV, instance_argv
from dist_infer.topology.cores import usable_cores
from dist_infer.topology.discovery import LAUNCHER_VARIABLES, discover, expand_slurm_nodelist
from dist_infer.topology.network import local_address_towards

# what srun sets for one step's tasks: an srun started from inside a step (say the front end's own,
# `srun -n 1 --overlap dist-infer serve ...`) must not take them for its own options
STEP_VARIABLES = (
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_GTIDS",
    "SLURM_TASK_PID",
    "SLURM_STEPID",
    "SLURM_STEP_",
    "SLURM_SRUN_COMM_",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_CPU_BIND",
    "SLURM_DISTRIBUTION",
    "SLURM_EXACT",
    "SLURM_OVERLAP",
    "SLURM_CPUS_ON_NODE",
    "SLURM_UMASK",
    "SLURM_PRIO_PROCESS",
)


class SlurmPlacementError(ValueError):
    """--placement slurm where it cannot work (no allocation, no srun, several front ends)."""


def check_allocation(env: Mapping[str, str]) -> str:
    """The allocation's job id, or a SlurmPlacementError saying why instances cannot be placed."""
    if not env.get("SLURM_JOB_ID"):
        raise SlurmPlacementError(
            "--placement slurm starts each instance as a job step of the allocation it runs in, "
            "and there is none (no $SLURM_JOB_ID): run serve in an sbatch script or under salloc"
        )
    if shutil.which("srun", path=env.get("PATH")) is None:
        raise SlurmPlacementError("--placement slurm: srun is not on PATH")
    info = discover(env)
    if info is not None and info.world_size > 1:
        raise SlurmPlacementError(
            f"--placement slurm runs one front end, and this is rank {info.rank} of "
            f"{info.world_size} ({info.launcher}): run serve once (in the batch script, or "
            f"srun --ntasks 1 --overlap)"
        )
    return env["SLURM_JOB_ID"]


def allocation_nodes(env: Mapping[str, str]) -> list[str]:
    return expand_slurm_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")


def hub_host(env: Mapping[str, str]) -> str:
    """Where the hub listens when --hub-host is not given: the loopback while the allocation is this
    host alone, else this host's address facing the allocation's other nodes (their drivers dial it)."""
    me = {socket.gethostname(), socket.gethostname().split(".")[0]}
    others = [n for n in allocation_nodes(env) if n not in me and n.split(".")[0] not in me]
    return local_address_towards(others[0]) if others else "127.0.0.1"


def step_env(env: Mapping[str, str], key: bytes) -> dict[str, str]:
    """The instance step's environment: the allocation's SLURM_* (srun needs them), without this
    process's own step and rendezvous variables (every step meets on its own node and port)."""
    out = {k: v for k, v in env.items() if k not in LAUNCHER_VARIABLES and not k.startswith(STEP_VARIABLES)}
    out[HUB_KEY_ENV] = key.decode()
    out.pop(HUB_FILE_ENV, None)
    if "OMP_NUM_THREADS" not in out and out.get("SLURM_CPUS_PER_TASK"):
        out["OMP_NUM_THREADS"] = out["SLURM_CPUS_PER_TASK"]  # the cores Slurm gives each rank
    return out


def srun_command(spec, name: str, instance: list[str]) -> list[str]:
    """srun for an instance: its spec.size ranks as one step on one node (pure; unit tested). Options
    for every step (--cpus-per-task, --gpus-per-task, ...) come from srun's own $SLURM_*/$SRUN_* input
    variables, which the front end passes on.
    --exact: the step takes only the CPUs it asks for, so the next instance's step finds the rest;
    --kill-on-bad-exit: a rank that fails ends the step (the instance dies whole, as a local job)."""
    return [
        "srun",
        "--nodes",
        "1",
        "--ntasks",
        str(spec.size),
        "--exact",
        "--kill-on-bad-exit=1",
        "--job-name",
        name,
        sys.executable,
        "-m",
        "dist_infer",
        *instance,
    ]


class SlurmStep(subprocess.Popen):
    """The srun of an instance's step, as the cluster handles a local job, with the node it runs on."""

    def __init__(self, command: list[str], env: dict, name: str, job_id: str, nodes: list[str]):
        super().__init__(command, env=env, start_new_session=True)
        self.step_name, self.job_id, self._env = name, job_id, env
        self._node = nodes[0] if len(nodes) == 1 else None  # one node: nothing to ask
        self._asked = 0.0

    @property
    def node(self) -> Optional[str]:
        """The node its step runs on (squeue, asked at most every 5 s until it answers)."""
        if self._node is None and self.poll() is None and time.monotonic() - self._asked > 5.0:
            self._asked = time.monotonic()
            self._node = step_node(self.job_id, self.step_name, self._env)
        return self._node


def step_node(job_id: str, name: str, env: Mapping[str, str]) -> Optional[str]:
    """The node of the job's step called `name`, from squeue; None if it is not (yet) listed."""
    try:
        out = subprocess.run(
            ["squeue", "--steps", "--noheader", "--jobs", job_id, "--format", "%j|%N"],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=5.0,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        step, _, nodes = line.strip().partition("|")
        if step == name and nodes:
            return nodes
    return None


class SlurmSpawner:
    """spawn(index, spec) -> SlurmStep: instance `index` started as a job step of this allocation."""

    def __init__(self, argv: list[str], hub: tuple, key: bytes, env: Optional[Mapping] = None):
        self.argv, self.hub = argv, hub
        self.env = dict(os.environ if env is None else env)
        self.job_id = check_allocation(self.env)
        self.nodes = allocation_nodes(self.env)
        self.base = step_env(self.env, key)

    def __call__(self, index: int, spec) -> SlurmStep:
        name = f"dist-infer-instance-{index}-{time.monotonic_ns() % 10**9}"  # a restart's step is told apart
        command = srun_command(spec, name, instance_argv(self.argv, index, spec, self.hub))
        logger.info(
            f"instance {index} ({spec.describe()}): job step {name} of Slurm job {self.job_id}: {' '.join(command)}"
        )
        return SlurmStep(command, self.base, name, self.job_id, self.nodes)

    def rank_capacity(self) -> RankBudget:
        """The ranks the allocation holds: its CPUs over each task's; this host's cores if it does not say."""
        return slurm_capacity(self.env) or local_capacity(usable_cores())

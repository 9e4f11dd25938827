"""Who am I in the job? Rank discovery from the environment each launcher leaves behind.

Pure functions over an environment mapping, so every launcher's convention is unit tested
without starting it. The MPI fallbacks (ask MPI itself, broadcast rank 0's address) live in
`resolve_with_mpi`, the only function here that touches a live runtime.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional

from dist_infer.topology.network import own_address

DEFAULT_MASTER_PORT = 29500

# What launchers leave in a rank's environment. A process that starts a job of its own (a peer
# benchmark, a test) strips these, or its children would think they are ranks of the outer job.
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
)
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "MPI_LOCAL", "MV2_", "SLURM_", "TORCHELASTIC_", "PRTE_")


def without_launcher_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of `env` with every launcher's rank variables removed."""
    return {k: v for k, v in env.items() if k not in LAUNCHER_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)}


class DiscoveryError(RuntimeError):
    """The environment describes an inconsistent job (a rank outside the world, say)."""


@dataclass(frozen=True)
class RankInfo:
    """One process's place in the job, as discovered from its launcher."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]
    launcher: str  # torchrun | openmpi | mpich | mvapich2 | slurm | mpi4py | single

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // max(1, self.local_world_size)))

    def env(self) -> dict[str, str]:
        """The torchrun-style variables that torch.distributed's env:// rendezvous reads."""
        out = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
        }
        if self.master_addr:
            out["MASTER_ADDR"] = self.master_addr
        if self.master_port:
            out["MASTER_PORT"] = str(self.master_port)
        return out


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as exc:
                raise DiscoveryError(f"environment variable {name}={value!r} is not an integer") from exc
    return None


def _int_or(env: Mapping[str, str], default: int, *names: str) -> int:
    """The first of `names` set to an integer, else `default` (set but empty counts as unset)."""
    value = _int(env, *names)
    return default if value is None else value


def parse_slurm_tasks_per_node(value: str) -> list[int]:
    """Slurm's per-node task counts, e.g. '2(x3),1' -> [2, 2, 2, 1] (SLURM_TASKS_PER_NODE format)."""
    counts = []
    for part in value.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not match:
            raise DiscoveryError(f"Slurm tasks per node {value!r}: cannot read {part!r} (expected N or N(xM))")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _slurm_local_world(env: Mapping[str, str], world: int, nodes: int) -> int:
    """Ranks on this node: its entry of the step's task counts (SLURM_STEP_TASKS_PER_NODE, then the
    allocation's SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE), else an even share."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        value = env.get(name)
        if value:
            counts = parse_slurm_tasks_per_node(value)
            node = _int(env, "SLURM_NODEID") or 0
            return counts[node] if node < len(counts) else counts[-1]
    return -(-world // nodes)


def _rank_and_size(env: Mapping[str, str], rank_var: str, size_var: str) -> tuple[int, int]:
    """Both variables of a launcher, or a DiscoveryError naming the one that is missing."""
    rank, size = _int(env, rank_var), _int(env, size_var)
    if rank is None or size is None:
        name, other = (rank_var, size_var) if rank is None else (size_var, rank_var)
        raise DiscoveryError(f"{name} is missing or empty while {other} is set")
    return rank, size


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list: 'gpu[01-03,07],login1' -> gpu01 gpu02 gpu03 gpu07 login1.

    Several bracket groups in one name expand as a product: 'r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2.
    """
    names, depth, current = [], 0, ""
    for ch in nodelist:  # split on the commas that are outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += ch
    names.append(current)
    hosts: list[str] = []
    for name in (n.strip() for n in names):
        if name:
            hosts.extend(_expand_brackets(name))
    return hosts


def _expand_brackets(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    out: list[str] = []
    for part in match.group(1).split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            values = [f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
        else:
            values = [part]
        for value in values:
            out.extend(head + value + rest for rest in _expand_brackets(tail))
    return out


SLURM_BATCH_STEP = "4294967294"  # the step id Slurm gives a batch script, where it says so


def slurm_task(env: Mapping[str, str]) -> bool:
    """True in a task of an srun job step. A batch script (sbatch) also has SLURM_PROCID=0 and the
    allocation's SLURM_NTASKS, but no step id: it is where `srun` is run from, not a rank of N."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return False
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return "SLURM_JOB_ID" not in env or step not in (None, "", SLURM_BATCH_STEP, "batch")


def slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of a job step when MASTER_PORT is not set: derived from the job and step
    ids, so steps side by side on one node (serve --placement slurm starts one per instance) do not
    all listen on 29500; below the ephemeral ports. DEFAULT_MASTER_PORT without the ids."""
    job, step = _int(env, "SLURM_JOB_ID", "SLURM_JOBID"), _int(env, "SLURM_STEP_ID", "SLURM_STEPID")
    if job is None or step is None:
        return DEFAULT_MASTER_PORT
    return 20000 + (job * 101 + step) % 10000


def _master(env: Mapping[str, str]) -> tuple[Optional[str], Optional[int]]:
    port = _int(env, "MASTER_PORT")
    return env.get("MASTER_ADDR") or None, port


def discover(env: Optional[Mapping[str, str]] = None) -> Optional[RankInfo]:
    """RankInfo from the launcher variables in `env`, or None when no launcher set any.

    Checked in order: torchrun (and our own `dist-infer launch`, which speaks torchrun's
    language), Open MPI, MVAPICH2, MPICH/Intel MPI (PMI), Slurm srun. MPI before Slurm because
    `mpirun` inside an allocation also inherits SLURM_* variables of the allocation.
    """
    env = os.environ if env is None else env
    addr, port = _master(env)

    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _rank_and_size(env, "RANK", "WORLD_SIZE")
        local_world = _int(env, "LOCAL_WORLD_SIZE") or world or 1
        info = RankInfo(
            rank=rank,
            world_size=world,
            local_rank=_int_or(env, rank % local_world, "LOCAL_RANK"),
            local_world_size=local_world,
            node_rank=_int_or(env, rank // local_world, "GROUP_RANK", "NODE_RANK"),
            master_addr=addr,
            master_port=port,
            launcher="torchrun",
        )
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _rank_and_size(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or 1
        info = RankInfo(
            rank=rank,
            world_size=world,
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
            local_world_size=local_world,
            node_rank=_int_or(env, rank // local_world, "OMPI_COMM_WORLD_NODE_RANK"),
            master_addr=addr,
            master_port=port,
            launcher="openmpi",
        )
    elif "MV2_COMM_WORLD_RANK" in env:
        rank, world = _rank_and_size(env, "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")
        local_world = _int(env, "MV2_COMM_WORLD_LOCAL_SIZE") or 1
        local = _int(env, "MV2_COMM_WORLD_LOCAL_RANK") or 0
        info = RankInfo(rank, world, local, local_world, rank // local_world, addr, port, "mvapich2")
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        rank, world = _rank_and_size(env, "PMI_RANK", "PMI_SIZE")
        local_world = _int(env, "MPI_LOCALNRANKS") or 1
        local = _int(env, "MPI_LOCALRANKID") or 0
        info = RankInfo(rank, world, local, local_world, rank // local_world, addr, port, "mpich")
    elif slurm_task(env):
        rank, world = _rank_and_size(env, "SLURM_PROCID", "SLURM_NTASKS")
        nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
        local_world = _slurm_local_world(env, world, nodes)
        # the step's first node: a step on part of the allocation does not meet on the job's first
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if addr is None and nodelist:
            hosts = expand_slurm_nodelist(nodelist)
            addr = hosts[0] if hosts else None
        info = RankInfo(
            rank=rank,
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID") or 0,
            local_world_size=local_world,
            node_rank=_int(env, "SLURM_NODEID") or 0,
            master_addr=addr,
            master_port=port or slurm_port(env),
            launcher="slurm",
        )
    else:
        return None

    validate(info)
    return info


def validate(info: RankInfo) -> None:
    if info.world_size < 1:
        raise DiscoveryError(f"{info.launcher}: world size {info.world_size} is not positive")
    if not 0 <= info.rank < info.world_size:
        raise DiscoveryError(f"{info.launcher}: rank {info.rank} is outside world size {info.world_size}")
    if not 0 <= info.local_rank < max(1, info.local_world_size):
        raise DiscoveryError(
            f"{info.launcher}: local rank {info.local_rank} is outside local world size {info.local_world_size}"
        )


def single_process() -> RankInfo:
    """A job of one: what a plain `python` run without any launcher is."""
    return RankInfo(0, 1, 0, 1, 0, "127.0.0.1", None, "single")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def resolve_with_mpi(info: Optional[RankInfo], comm=None, port_picker: Callable[[], int] = free_port) -> RankInfo:
    """Fill what the launcher did not set, asking MPI (mpi4py) itself.

    Covers `mpirun` (nobody sets MASTER_ADDR: rank 0 broadcasts its address and a free port,
    DeepSpeed's answer) and MPI-only launches whose variables we do not know (rank and size from
    the communicator, local rank from processor names).
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    if info is None:
        names = comm.allgather(socket.gethostname())
        rank, world = comm.Get_rank(), comm.Get_size()
        me = names[rank]
        hosts_in_order = list(dict.fromkeys(names))
        info = RankInfo(
            rank=rank,
            world_size=world,
            local_rank=sum(1 for n in names[:rank] if n == me),
            local_world_size=names.count(me),
            node_rank=hosts_in_order.index(me),
            master_addr=None,
            master_port=None,
            launcher="mpi4py",
        )
    if info.master_addr and info.master_port:
        return info
    payload = None
    if comm.Get_rank() == 0:
        addr = info.master_addr or ("127.0.0.1" if info.num_nodes == 1 else own_address())
        payload = (addr, info.master_port or port_picker())
    addr, port = comm.bcast(payload, root=0)
    return replace(info, master_addr=addr, master_port=port)


def needs_mpi(info: Optional[RankInfo]) -> bool:
    """True when only MPI can complete the picture (launched by an MPI, no rendezvous set)."""
    if info is None:
        return False
    return info.launcher in ("openmpi", "mpich", "mvapich2", "mpi4py") and not (info.master_addr and info.master_port)

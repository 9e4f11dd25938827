"""How many ranks a server may run at once (`serve --max-ranks`), and the check every start goes
through: the instances at start-up, an operator's scale-up and restart, an automatic restart and
the autoscaler's. A start is refused before anything runs when the ranks of the instances running
or starting, plus the new layout's, would pass the budget: one admin POST with `tp=99999` must not
start rank after rank until the host runs out of memory.

The default budget is what the placement has (each spawner's `rank_capacity()`): this host's usable
cores for local jobs, the Ray cluster's CPUs (or GPUs, when ranks take GPUs) over what one rank
reserves, the Slurm allocation's CPUs over --cpus-per-task. Pure; unit tested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional

FLAG = "--max-ranks"


class RankBudgetError(ValueError):
    """A start that would pass the rank budget. `ever_fits`: it would fit once other instances stop
    (409 for an operator); False: it never fits (400)."""

    def __init__(self, message: str, ever_fits: bool):
        super().__init__(message)
        self.ever_fits = ever_fits


@dataclass(frozen=True)
class RankBudget:
    """At most `limit` ranks at once; `origin` says where a default came from ('' when --max-ranks gave it)."""

    limit: int
    origin: str = ""

    def describe(self) -> str:
        return f"{FLAG} is {self.limit}" + (f", {self.origin}" if self.origin else "")

    def check(self, what: str, need: int, held: Optional[int] = None) -> None:
        """Refuse `what` (e.g. 'layout tp=2'), which needs `need` ranks beside the `held` ones
        running or starting (None: nothing runs yet, at start-up)."""
        if need + (held or 0) <= self.limit:
            return
        running = "" if held is None else f" ({held} running)"
        raise RankBudgetError(
            f"{what} needs {need} rank{'s' * (need != 1)}; {self.describe()}{running}", ever_fits=need <= self.limit
        )

    def room(self, held: int) -> int:
        """Ranks still free beside the `held` ones."""
        return max(0, self.limit - held)


def local_capacity(cores: int) -> RankBudget:
    """Local jobs: a rank per usable core of this host (more would share cores and only run slower)."""
    return RankBudget(max(1, cores), f"the default: this host's {cores} usable cores")


def ray_capacity(resources: Mapping[str, float], cpus_per_rank: int, gpus_per_rank: int = 0) -> RankBudget:
    """Ray: the cluster's CPUs over each rank's CPUs, and its GPUs over each rank's GPUs when ranks take
    GPUs (`ray.cluster_resources()`); one rank per CPU when a rank reserves none."""
    cpus, per_cpu = int(resources.get("CPU", 0)), max(1, cpus_per_rank)
    limits = [(cpus // per_cpu, f"the Ray cluster's {cpus} CPUs / {per_cpu} per rank")]
    if gpus_per_rank:
        gpus = int(resources.get("GPU", 0))
        limits.append((gpus // gpus_per_rank, f"the Ray cluster's {gpus} GPUs / {gpus_per_rank} per rank"))
    limit, origin = min(limits)
    return RankBudget(limit, f"the default: {origin}")


_CPUS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def slurm_cpus(text: str) -> Optional[int]:
    """SLURM_JOB_CPUS_PER_NODE ('36(x2),72': two nodes of 36 and one of 72) -> 144; None if unreadable."""
    total = 0
    for item in (text or "").split(","):
        m = _CPUS_ITEM.fullmatch(item.strip())
        if m is None:
            return None
        total += int(m.group(1)) * int(m.group(2) or 1)
    return total or None


def slurm_capacity(env: Mapping[str, str]) -> Optional[RankBudget]:
    """Slurm: the allocation's CPUs over each task's (every instance step takes its CPUs with --exact);
    None when the allocation does not say (no SLURM_JOB_CPUS_PER_NODE)."""
    cpus = slurm_cpus(env.get("SLURM_JOB_CPUS_PER_NODE", ""))
    if cpus is None:
        return None
    per_task = env.get("SRUN_CPUS_PER_TASK") or env.get("SLURM_CPUS_PER_TASK") or "1"
    per_task_n = int(per_task) if per_task.isdigit() and int(per_task) > 0 else 1
    return RankBudget(
        max(1, cpus // per_task_n), f"the default: the Slurm allocation's {cpus} CPUs / {per_task_n} per task"
    )

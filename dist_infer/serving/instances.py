"""Several model instances behind one API: `--instances tp2,tp1,tp1` (or `--instances 3` with
--tp/--pp), each optionally with a role: `prefill:tp2,decode:tp1,decode:tp1`.

Started in one job, each instance gets a consecutive range of world ranks and its own mesh
inside it, so its step loop, tensor- and pipeline-parallel groups are its own. After start-up
no instance waits on another's ranks: KV blocks move between instances over each rank's own
link (comm/peer_link.py), so an instance can die, be stopped, or be started again as a job of
its own (`serve --join`) while the others serve on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dist_infer.topology import Mesh, ParallelConfig

from dist_infer.serving.wire import Role

if TYPE_CHECKING:  # torch: the launcher parses --instances before any rank starts, without it
    from dist_infer.comm import ParallelGroups
    from dist_infer.comm.base import Communicator

ROLES = tuple(Role)


class InstancesError(ValueError):
    """An --instances value that does not parse or does not fit the world."""


@dataclass(frozen=True)
class InstanceSpec:
    """One instance's layout and role: 'prefill' instances take new prompts and hand each request
    to a 'decode' instance after its first token; 'mixed' ones do both (the default)."""

    tp: int = 1
    pp: int = 1
    role: Role = Role.MIXED

    @property
    def size(self) -> int:
        return self.tp * self.pp

    @property
    def layout(self) -> str:
        return f"tp{self.tp}" + (f"pp{self.pp}" if self.pp > 1 else "")

    def describe(self) -> str:
        return self.layout if self.role == Role.MIXED else f"{self.role}:{self.layout}"


_ITEM = re.compile(r"^(?:(mixed|prefill|decode):)?(?:tp(\d+))?(?:pp(\d+))?$")


def parse_instances(text: str, tp: int = 1, pp: int = 1) -> list[InstanceSpec]:
    """'3' -> three instances of tp x pp; 'tp2,tp1,tp2pp2' -> one per item."""
    text = (text or "").strip()
    if text.isdigit():
        if int(text) < 1:
            raise InstancesError(f"--instances {text}: at least one instance")
        return [InstanceSpec(tp, pp)] * int(text)
    specs = []
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if not item.strip() or m is None or not (m.group(2) or m.group(3)):
            raise InstancesError(f"--instances {text!r}: item {item.strip()!r} is not a count or a layout like "
                                 f"tp2, pp2, tp2pp2, optionally with a role: prefill:tp2, decode:tp1")
        spec = InstanceSpec(int(m.group(2) or 1), int(m.group(3) or 1), Role(m.group(1) or Role.MIXED))
        if spec.tp < 1 or spec.pp < 1:
            raise InstancesError(f"--instances {text!r}: item {item.strip()!r} has a size below 1")
        specs.append(spec)
    return specs


def check_roles(specs: list[InstanceSpec]) -> None:
    """A server's instances together must both prefill and decode."""
    roles = {s.role for s in specs}
    if (Role.PREFILL in roles) != (Role.DECODE in roles) and Role.MIXED not in roles:
        raise InstancesError(f"--instances {','.join(s.describe() for s in specs)}: prefill instances need a decode "
                             f"(or mixed) instance to hand requests to, and decode instances need one that prefills")


def base_ranks(specs: list[InstanceSpec]) -> list[int]:
    """The first world rank of each instance."""
    out, at = [], 0
    for spec in specs:
        out.append(at)
        at += spec.size
    return out


def check_world(specs: list[InstanceSpec], world_size: int) -> None:
    need = sum(s.size for s in specs)
    if need != world_size:
        sizes = " + ".join(f"{s.describe()}={s.size}" for s in specs)
        raise InstancesError(f"--instances needs {sizes} = {need} ranks, the job has {world_size}")


def instance_of(specs: list[InstanceSpec], rank: int) -> int:
    for i, base in enumerate(base_ranks(specs)):
        if base <= rank < base + specs[i].size:
            return i
    raise InstancesError(f"rank {rank} is outside the {sum(s.size for s in specs)} ranks of the instances")


def join_instance(world: Communicator, specs: list[InstanceSpec], shm: str = "auto") -> tuple[int, ParallelGroups]:
    """Collective over the world: this rank's instance index and that instance's groups."""
    check_world(specs, world.size)
    ranges = [list(range(b, b + s.size)) for b, s in zip(base_ranks(specs), specs)]
    mine = instance_of(specs, world.rank)
    comm = world if len(specs) == 1 else world.split(ranges, "instance")
    spec = specs[mine]
    from dist_infer.comm import build_groups

    mesh = Mesh.build(ParallelConfig(tp=spec.tp, pp=spec.pp), spec.size)
    return mine, build_groups(comm, mesh, shm)

"""Several model instances behind one API: `--instances "tp=2; tp=1; tp=1"` (or `--instances 3`
with --tp/--pp), each optionally with a role: `"prefill:tp=2; decode:tp=1; decode:tp=1"`. The
older comma list of compact layouts (`tp2,tp1,tp2pp2`, `prefill:tp2,decode:tp1`) is still read.

Started in one job, each instance gets a consecutive range of world ranks and its own mesh
inside it, so its step loop, tensor- and pipeline-parallel groups are its own. After start-up
no instance waits on another's ranks: KV blocks move between instances over each rank's own
link (comm/peer_link.py), so an instance can die, be stopped, or be started again as a job of
its own (`serve --join`) while the others serve on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from dist_infer.topology import Layout, LayoutError, Mesh, parse_layout

from dist_infer.serving.wire import Role

if TYPE_CHECKING:  # torch: the launcher parses --instances before any rank starts, without it
    from dist_infer.comm import ParallelGroups
    from dist_infer.comm.base import Communicator

ROLES = tuple(Role)
SERVED_AXES = ("tp", "pp")  # what an instance's own mesh runs (join_instance); cp, ep and dp are not per instance
FORMS = "e.g. \"prefill:tp=2,pp=2; decode:tp=1\" or the older tp2,tp1,tp2pp2, or a count"


class InstancesError(ValueError):
    """An --instances value that does not parse or does not fit the world."""


@dataclass(frozen=True, init=False)
class InstanceSpec:
    """One instance's layout and role: 'prefill' instances take new prompts and hand each request
    to a 'decode' instance after its first token; 'mixed' ones do both (the default)."""

    parallel: Layout
    role: Role

    def __init__(self, parallel: Union[Layout, int] = 1, pp: Union[int, Role, str, None] = None,
                 role: Union[Role, str, None] = None):
        """InstanceSpec(Layout(tp=2), role), or InstanceSpec(tp, pp, role) as older callers (and the
        Hello a driver sends: tp, pp, role) still write it."""
        if isinstance(parallel, Layout):
            if pp is not None and role is not None:
                raise TypeError("InstanceSpec(layout, role): the layout already has its pp")
            layout, role = parallel, role if role is not None else pp
        else:
            layout = Layout(tp=parallel, pp=1 if pp is None else pp)
        object.__setattr__(self, "parallel", layout)
        object.__setattr__(self, "role", Role(role or Role.MIXED))

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def size(self) -> int:
        return self.parallel.ranks

    @property
    def layout(self) -> str:
        """The canonical layout text, e.g. 'tp=2,pp=2' (a string: it travels in the Hello and the status)."""
        return self.parallel.describe()

    def describe(self) -> str:
        """One --instances item that reads back as this spec, e.g. 'prefill:tp=2,pp=2'."""
        return self.layout if self.role == Role.MIXED else f"{self.role}:{self.layout}"


MAX_INSTANCE_COUNT = 1024  # a count past any job's ranks (check_world refuses it anyway); bounds the list made


def parse_instances(text: str, tp: int = 1, pp: int = 1) -> list[InstanceSpec]:
    """'prefill:tp=2,pp=2; decode:tp=1' (items separated by ';' or spaces) -> one instance per item;
    'tp2,tp1,tp2pp2' (the older comma list of compact layouts) too; '3' -> three of tp x pp."""
    text = (text or "").strip()
    if text.isascii() and text.isdigit():
        if not 1 <= int(text) <= MAX_INSTANCE_COUNT:
            raise InstancesError(f"--instances {text}: from 1 to {MAX_INSTANCE_COUNT} instances")
        return [InstanceSpec(Layout(tp=tp, pp=pp))] * int(text)
    return [_spec(parts, text) for parts in _items(text)]


def _items(text: str) -> list[list[str]]:
    """The items of `text`, each a list of comma-separated parts. ';' and spaces end an item; in a
    comma list a part with a role or in the compact form (tp2) starts a new one, and an 'axis=n'
    part joins the 'axis=n' item before it: 'tp2,tp1' is two items, 'tp=2,pp=2' one."""
    tight = re.sub(r"\s*([,:=])\s*", r"\1", text)
    items: list[list[str]] = []
    for chunk in re.split(r"\s*;\s*|\s+", tight):
        joinable: Optional[list[str]] = None
        for part in chunk.split(","):
            if joinable is not None and ":" not in part and "=" in part:
                joinable.append(part)
                continue
            items.append([part])
            joinable = items[-1] if "=" in part else None
    return items


def _spec(parts: list[str], text: str) -> InstanceSpec:
    """One item's spec; InstancesError naming the item and its bad part."""
    item = ",".join(parts)
    if not item:
        raise InstancesError(f"--instances {text!r}: an empty item (two separators in a row?); write {FORMS}")
    role, colon, first = parts[0].rpartition(":")
    if colon and role not in ROLES:
        raise InstancesError(f"--instances {text!r}: item {item!r} has the unknown role {role!r} "
                             f"(roles: {', '.join(ROLES)})")
    try:
        layout = parse_layout(",".join([first, *parts[1:]]))
    except LayoutError as exc:
        raise InstancesError(f"--instances {text!r}: item {item!r}: {exc}") from None
    unserved = [f"{a}={v}" for a, v in layout.as_dict().items() if a not in SERVED_AXES and (v != 1 or a == "dp")]
    if unserved:
        hint = "; more replicas are more items" if layout.dp is not None else ""
        raise InstancesError(f"--instances {text!r}: item {item!r} asks for {', '.join(unserved)}: an instance "
                             f"runs {' and '.join(SERVED_AXES)} only{hint}")
    return InstanceSpec(layout, role or Role.MIXED)


def check_roles(specs: list[InstanceSpec]) -> None:
    """A server's instances together must both prefill and decode."""
    roles = {s.role for s in specs}
    if (Role.PREFILL in roles) != (Role.DECODE in roles) and Role.MIXED not in roles:
        raise InstancesError(f"--instances {'; '.join(s.describe() for s in specs)!r}: prefill instances need a decode "
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
        sizes = " + ".join(f"{s.size} ({s.describe()})" for s in specs)
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

    mesh = Mesh.build(spec.parallel, spec.size)
    return mine, build_groups(comm, mesh, shm)

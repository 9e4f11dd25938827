"""Several model instances behind one API: `--instances "tp=2; tp=1; tp=1"` (or `--instances 3`
with --tp/--pp), each optionally with a role: `"prefill:tp=2; decode:tp=1; decode:tp=1"`. The
older comma list of compact layouts (`tp2,tp1,tp2pp2`, `prefill:tp2,decode:tp1`) is still read.

Started in one job, each instance gets a consecutive range of world ranks and its own mesh
inside it, so its step loop, tensor- and pipeline-parallel groups are its own. After start-up
no instance waits on another's ranks: KV blocks move between instances over each rank's own
link (comm/peer/link.py), so an instance can die, be stopped, or be started again as a job of
its own (`serve --join`) while the others serve on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Union, overload

from dist_infer.serving.fleet.wire import Hello, Role
from dist_infer.topology import DISPLAY_ORDER, Layout, LayoutError, Mesh, parse_layout

if TYPE_CHECKING:  # torch: the launcher parses --instances before any rank starts, without it
    from dist_infer.comm import ParallelGroups
    from dist_infer.comm.base import Communicator

ROLES = tuple(Role)
SERVED_AXES = ("tp", "pp")  # what an instance's own mesh runs (join_instance); cp, ep and dp are not per instance
FORMS = 'e.g. "prefill:tp=2,pp=2; decode:tp=1" or the older tp2,tp1,tp2pp2, or a count'


class InstancesError(ValueError):
    """An --instances value that does not parse or does not fit the world."""


@dataclass(frozen=True, init=False)
class InstanceSpec:
    """One instance's layout and role: 'prefill' instances take new prompts and hand each request
    to a 'decode' instance after its first token; 'mixed' ones do both (the default)."""

    parallel: Layout
    role: Role

    @overload
    def __init__(
        self, parallel: Layout, pp: Union[Role, str, None] = None, role: Union[Role, str, None] = None
    ) -> None: ...

    @overload
    def __init__(self, parallel: int = 1, pp: Optional[int] = None, role: Union[Role, str, None] = None) -> None: ...

    def __init__(
        self,
        parallel: Union[Layout, int] = 1,
        pp: Union[int, Role, str, None] = None,
        role: Union[Role, str, None] = None,
    ) -> None:
        """InstanceSpec(Layout(tp=2), role), or InstanceSpec(tp, pp, role) as older callers (and the
        Hello a driver sends: tp, pp, role) still write it."""
        if isinstance(parallel, Layout):
            named = role if role is not None else pp  # the second argument is the role
            if (pp is not None and role is not None) or isinstance(named, int):
                raise TypeError("InstanceSpec(layout, role): the layout already has its pp")
            layout = parallel
        else:
            if isinstance(pp, str):
                raise TypeError(f"InstanceSpec(tp, pp, role): pp is a count, not {pp!r}")
            layout, named = Layout(tp=parallel, pp=1 if pp is None else pp), role
        object.__setattr__(self, "parallel", layout)
        object.__setattr__(self, "role", Role(named or Role.MIXED))

    @classmethod
    def of_hello(cls, hello: Hello) -> "InstanceSpec":
        """The layout and role a driver's hello says its instance runs."""
        return cls(hello.tp, hello.pp, hello.role)

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
CHARS_PER_RANK = 64  # with a rank bound, a longer text is refused unread: every item has a rank or more
MAX_ITEM_PARTS = len(DISPLAY_ORDER)  # an item's 'axis=n' parts: one per axis; one more repeats an axis


class TooManyRanks(InstancesError):
    """--instances whose ranks pass the bound the parser was given; `ranks`: what it had counted
    when it stopped (a lower bound of the whole, the whole for one item)."""

    def __init__(self, message: str, ranks: int):
        super().__init__(message)
        self.ranks = ranks


def parse_instances(text: str, tp: int = 1, pp: int = 1, max_ranks: Optional[int] = None) -> list[InstanceSpec]:
    """'prefill:tp=2,pp=2; decode:tp=1' (items separated by ';' or spaces) -> one instance per item;
    'tp2,tp1,tp2pp2' (the older comma list of compact layouts) too; '3' -> three of tp x pp.
    `max_ranks`: refuse (TooManyRanks) as soon as the ranks counted so far pass it, before
    reading further (a request body's layout may be long)."""
    text = (text or "").strip()
    if max_ranks is not None and len(text) > CHARS_PER_RANK * max_ranks:
        raise InstancesError(
            f"--instances {_short(text)!r}: {len(text)} characters, longer than any layout of at "
            f"most {max_ranks} ranks (--max-ranks) is written ({CHARS_PER_RANK} per rank)"
        )
    if text.isascii() and text.isdigit():
        if len(text) > len(str(MAX_INSTANCE_COUNT)) or not 1 <= int(text) <= MAX_INSTANCE_COUNT:
            raise InstancesError(f"--instances {_short(text)}: from 1 to {MAX_INSTANCE_COUNT} instances")
        spec = InstanceSpec(Layout(tp=tp, pp=pp))
        _check_ranks(text, int(text) * spec.size, max_ranks, more=False)
        return [spec] * int(text)
    specs, ranks, items = [], 0, _items(text)
    for parts in items:
        specs.append(_spec(parts, text))
        ranks += specs[-1].size
        if max_ranks is not None and ranks > max_ranks:
            _check_ranks(text, ranks, max_ranks, more=next(items, None) is not None)
    return specs


def _check_ranks(text: str, ranks: int, max_ranks: Optional[int], more: bool) -> None:
    """TooManyRanks past `max_ranks`; `more`: items not read yet, which would only add ranks."""
    if max_ranks is not None and ranks > max_ranks:
        raise TooManyRanks(
            f"--instances {_short(text)!r} needs {ranks}{' or more' if more else ''} ranks; --max-ranks is {max_ranks}",
            ranks,
        )


def _short(text: str, limit: int = 200) -> str:
    """`text` as an error message quotes it: a long one cut (a request body's layout may be megabytes)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _pieces(text: str, separator: str) -> Iterator[str]:
    """re.split(separator, text), one piece at a time (no list of every piece of a long text)."""
    start = 0
    for m in re.finditer(separator, text):
        yield text[start : m.start()]
        start = m.end()
    yield text[start:]


def _items(text: str) -> Iterator[list[str]]:
    """The items of `text`, each a list of comma-separated parts. ';' and spaces end an item; in a
    comma list a part with a role or in the compact form (tp2) starts a new one, and an 'axis=n'
    part joins the 'axis=n' item before it: 'tp2,tp1' is two items, 'tp=2,pp=2' one."""
    tight = re.sub(r"\s*([,:=])\s*", r"\1", text)
    for chunk in _pieces(tight, r"\s*;\s*|\s+"):
        parts = _pieces(chunk, ",")
        item = [next(parts)]  # (a chunk has at least one part, maybe empty)
        for part in parts:
            if (
                "=" in item[0] and ":" not in part and "=" in part and len(item) <= MAX_ITEM_PARTS
            ):  # past it, _spec names the axis given twice
                item.append(part)
                continue
            yield item
            item = [part]
        yield item


def _spec(parts: list[str], text: str) -> InstanceSpec:
    """One item's spec; InstancesError naming the item and its bad part."""
    item = ",".join(parts)
    if not item:
        raise InstancesError(f"--instances {_short(text)!r}: an empty item (two separators in a row?); write {FORMS}")
    role, colon, first = parts[0].rpartition(":")
    if colon and role not in ROLES:
        raise InstancesError(
            f"--instances {_short(text)!r}: item {_short(item)!r} has the unknown role {role!r} "
            f"(roles: {', '.join(ROLES)})"
        )
    try:
        layout = parse_layout(",".join([first, *parts[1:]]))
    except LayoutError as exc:
        raise InstancesError(f"--instances {_short(text)!r}: item {_short(item)!r}: {exc}") from None
    unserved = [f"{a}={v}" for a, v in layout.as_dict().items() if a not in SERVED_AXES and (v != 1 or a == "dp")]
    if unserved:
        hint = "; more replicas are more items" if layout.dp is not None else ""
        raise InstancesError(
            f"--instances {_short(text)!r}: item {_short(item)!r} asks for {', '.join(unserved)}: an instance "
            f"runs {' and '.join(SERVED_AXES)} only{hint}"
        )
    return InstanceSpec(layout, role or Role.MIXED)


def check_roles(specs: list[InstanceSpec]) -> None:
    """A server's instances together must both prefill and decode."""
    roles = {s.role for s in specs}
    if (Role.PREFILL in roles) != (Role.DECODE in roles) and Role.MIXED not in roles:
        raise InstancesError(
            f"--instances {'; '.join(s.describe() for s in specs)!r}: prefill instances need a decode "
            f"(or mixed) instance to hand requests to, and decode instances need one that prefills"
        )


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

"""Hostfiles: which hosts take part and how many ranks (slots) each runs.

Two formats are accepted, line by line, and may be mixed:
  host slots=N    DeepSpeed and Open MPI
  host:N | host   MPICH Hydra (a bare host has one slot)
`#` starts a comment; blank lines are ignored. Errors name the file and the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Union

_HOST = r"[A-Za-z0-9_.\-]+"
_SLOTS_FORM = re.compile(rf"^({_HOST})\s+slots\s*=\s*(\S+)$")
_COLON_FORM = re.compile(rf"^({_HOST}):(\S+)$")
_BARE_FORM = re.compile(rf"^({_HOST})$")


class HostfileError(ValueError):
    """A hostfile that cannot describe a job; the message names the file and line."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def _slots(value: str, where: str) -> int:
    if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
        raise HostfileError(f"{where}: slots must be a positive integer, got {value!r}")
    return int(value)


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[Host]:
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        if m := _SLOTS_FORM.match(line):
            name, slots = m.group(1), _slots(m.group(2), where)
        elif m := _COLON_FORM.match(line):
            name, slots = m.group(1), _slots(m.group(2), where)
        elif m := _BARE_FORM.match(line):
            name, slots = m.group(1), 1
        else:
            raise HostfileError(f"{where}: malformed line {raw.strip()!r}; expected 'host slots=N', 'host:N' or 'host'")
        if name in seen:
            raise HostfileError(f"{where}: host {name!r} appears twice (first on line {seen[name]})")
        seen[name] = lineno
        hosts.append(Host(name, slots))
    if not hosts:
        raise HostfileError(f"{source}: no hosts (the file is empty or only comments)")
    return hosts


def parse_hostfile(path: Union[str, Path]) -> list[Host]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise HostfileError(f"{path}: cannot read hostfile: {exc.strerror or exc}") from exc
    return parse_hostfile_text(text, str(path))


def node_rank_offsets(hosts: list[Host]) -> list[int]:
    """Global rank of each host's first slot: ranks are numbered host by host, in file order."""
    offsets, total = [], 0
    for host in hosts:
        offsets.append(total)
        total += host.slots
    return offsets

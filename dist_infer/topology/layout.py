"""The one layout type: how many ranks split each layer (tp), the layers (pp), the sequence (cp)
and the experts (ep), and how many replicas there are (dp); and the one way to write it.

Canonical text: `tp=2,pp=2` (commas or spaces; axes left out are 1). The compact `tp2pp2` that
--instances used to take is kept as an alias. Plain Python, no torch: the planner and the
launcher parse layouts before any rank starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# The order a layout is written in. Not the mesh's rank order (mesh.RANK_ORDER), which says which
# axis varies fastest along the ranks.
DISPLAY_ORDER = ("tp", "pp", "cp", "ep", "dp")
MODEL_AXES = ("tp", "pp", "cp", "ep")  # the axes that split one replica; dp counts replicas
EXAMPLE = "tp=2,pp=2 (or the compact tp2pp2)"

_COMPACT_PAIR = re.compile(r"(tp|pp|cp|ep|dp)(\d+)")
_COMPACT = re.compile(r"(?:(?:tp|pp|cp|ep|dp)\d+)+")


class LayoutError(ValueError):
    """A layout that cannot be parsed or run; the message names the bad part."""


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel axes; dp None means whatever the world has left after tp x pp x cp x ep."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: Optional[int] = None

    @property
    def ranks(self) -> int:
        """Ranks one replica needs (tp x pp x cp x ep; attention is replicated over ep, the experts
        split over it)."""
        return self.tp * self.pp * self.cp * self.ep

    def sizes(self, world_size: int) -> dict[str, int]:
        """Size of every axis for `world_size` ranks, dp derived when not given; validates."""
        for axis in MODEL_AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{axis}={value!r} must be a positive integer")
        model = self.ranks
        arithmetic = f"tp={self.tp} x pp={self.pp} x ep={self.ep} x cp={self.cp} = {model}"
        if self.dp is None:
            if world_size % model:
                raise LayoutError(
                    f"{arithmetic} does not divide the world size {world_size} "
                    f"({world_size} % {model} = {world_size % model})"
                )
            dp = world_size // model
        else:
            if not isinstance(self.dp, int) or self.dp < 1:
                raise LayoutError(f"dp={self.dp!r} must be a positive integer")
            dp = self.dp
            if model * dp != world_size:
                raise LayoutError(f"{arithmetic} x dp={dp} = {model * dp}, but the world size is {world_size}")
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": dp, "pp": self.pp}

    def describe(self) -> str:
        """Canonical text, e.g. 'tp=2,pp=2': axes of 1 left out ('tp=1' when all are); dp shown
        whenever it is given, since dp=1 (exactly one replica) differs from no dp."""
        parts = [f"{a}={getattr(self, a)}" for a in MODEL_AXES if getattr(self, a) != 1] or ["tp=1"]
        if self.dp is not None:
            parts.append(f"dp={self.dp}")
        return ",".join(parts)

    def as_dict(self) -> dict:
        """tp, pp, cp and ep, and dp when it is given."""
        out = {a: getattr(self, a) for a in MODEL_AXES}
        if self.dp is not None:
            out["dp"] = self.dp
        return out


def parse_layout(text: str) -> Layout:
    """'tp=2,pp=2' or 'tp=2 pp=2' (canonical) or 'tp2pp2' (the compact alias); axes left out are 1."""
    parts = [p for p in re.split(r"[,\s]+", text or "") if p]
    if not parts:
        raise LayoutError(f"empty layout {text!r}: write e.g. {EXAMPLE}")
    values: dict[str, int] = {}
    for part in parts:
        for axis, number in _axis_values(part, text):
            if axis in values:
                raise LayoutError(f"bad layout part {part!r} in {text!r}: {axis} is given twice")
            values[axis] = number
    return Layout(**values)


def _axis_values(part: str, text: str) -> list[tuple[str, int]]:
    """The (axis, size) pairs of one part: 'tp=2', or a compact run like 'tp2pp2'."""

    def bad(why: str) -> LayoutError:
        return LayoutError(f"bad layout part {part!r} in {text!r}: {why}")

    axis, sep, size = part.partition("=")
    if sep:
        if axis not in DISPLAY_ORDER:
            raise bad(f"unknown axis {axis!r} (axes: {', '.join(DISPLAY_ORDER)})")
        try:
            pairs = [(axis, int(size))]
        except ValueError:
            raise bad(f"{size!r} is not an integer") from None
    elif _COMPACT.fullmatch(part):
        pairs = [(a, int(n)) for a, n in _COMPACT_PAIR.findall(part)]
    else:
        raise bad(f"write e.g. {EXAMPLE} (axes: {', '.join(DISPLAY_ORDER)})")
    for name, value in pairs:
        if value < 1:
            raise bad(f"{name}={value}: sizes are positive")
    return pairs

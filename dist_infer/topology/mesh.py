"""ParallelConfig and the mesh: which ranks form each tp, pp, ep, cp and dp group.

Rank order (fastest varying first): tp, cp, ep, dp, pp, i.e.
    rank = tp_i + tp * (cp_i + cp * (ep_i + ep * (dp_i + dp * pp_i)))
tp is innermost so a tensor-parallel group, the chattiest, is made of consecutive ranks and
stays inside a node; pp is outermost because stage-to-stage traffic is the lightest and can
cross nodes. This module only computes rank lists; `dist_infer.comm.groups` turns them into
communicators.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

from loguru import logger

AXES = ("tp", "cp", "ep", "dp", "pp")  # fastest varying first


class ParallelConfigError(ValueError):
    """Parallel sizes that do not fit the world; the message shows the arithmetic."""


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    dp: Optional[int] = None  # None: whatever is left of the world

    def sizes(self, world_size: int) -> dict[str, int]:
        """Size of every axis for `world_size` ranks, dp derived when not given; validates."""
        for axis in ("tp", "pp", "ep", "cp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"{axis}={value!r} must be a positive integer")
        model = self.tp * self.pp * self.ep * self.cp
        arithmetic = f"tp={self.tp} x pp={self.pp} x ep={self.ep} x cp={self.cp} = {model}"
        if self.dp is None:
            if world_size % model:
                raise ParallelConfigError(
                    f"{arithmetic} does not divide the world size {world_size} "
                    f"({world_size} % {model} = {world_size % model})"
                )
            dp = world_size // model
        else:
            if self.dp < 1:
                raise ParallelConfigError(f"dp={self.dp!r} must be a positive integer")
            dp = self.dp
            if model * dp != world_size:
                raise ParallelConfigError(f"{arithmetic} x dp={dp} = {model * dp}, but the world size is {world_size}")
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": dp, "pp": self.pp}


@dataclass(frozen=True)
class Mesh:
    """The coordinates of every rank on the five axes."""

    sizes: dict  # axis -> size, see AXES

    @classmethod
    def build(cls, config: ParallelConfig, world_size: int) -> "Mesh":
        return cls(config.sizes(world_size))

    @property
    def world_size(self) -> int:
        n = 1
        for axis in AXES:
            n *= self.sizes[axis]
        return n

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out = {}
        for axis in AXES:
            out[axis] = rank % self.sizes[axis]
            rank //= self.sizes[axis]
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for axis in AXES:
            rank += coords.get(axis, 0) * stride
            stride *= self.sizes[axis]
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: ranks that differ only in their `axis` coordinate.

        Listed in a fixed order, identical on all ranks, as collective group creation requires.
        """
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
        others = [a for a in AXES if a != axis]
        out = []
        for fixed in itertools.product(*(range(self.sizes[a]) for a in reversed(others))):
            coords = dict(zip(reversed(others), fixed))
            out.append([self.rank_of({**coords, axis: i}) for i in range(self.sizes[axis])])
        return sorted(out)

    def group_of(self, axis: str, rank: int) -> list[int]:
        for group in self.groups(axis):
            if rank in group:
                return group
        raise AssertionError("every rank is in one group per axis")

    def tp_crosses_nodes(self, local_world_size: int) -> bool:
        """True when some TP group spans two nodes of `local_world_size` ranks each."""
        return any(len({r // local_world_size for r in g}) > 1 for g in self.groups("tp"))

    def warn_about_layout(self, local_world_size: int) -> None:
        if self.tp_crosses_nodes(local_world_size):
            logger.warning(
                f"tensor-parallel groups of {self.sizes['tp']} ranks cross node boundaries "
                f"({local_world_size} ranks per node): every layer's all-reduce will go over the network; "
                f"choose tp dividing {local_world_size}"
            )

    def describe(self) -> str:
        return " x ".join(f"{a}={self.sizes[a]}" for a in reversed(AXES))

"""The mesh of a Layout: which ranks form each tp, pp, ep, cp and dp group.

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

from loguru import logger

from dist_infer.topology.layout import Layout

RANK_ORDER = ("tp", "cp", "ep", "dp", "pp")  # fastest varying first along the ranks; not how a layout is written


@dataclass(frozen=True)
class Mesh:
    """The coordinates of every rank on the five axes."""

    sizes: dict  # axis -> size, see RANK_ORDER

    @classmethod
    def build(cls, layout: Layout, world_size: int) -> "Mesh":
        return cls(layout.sizes(world_size))

    @property
    def world_size(self) -> int:
        n = 1
        for axis in RANK_ORDER:
            n *= self.sizes[axis]
        return n

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out = {}
        for axis in RANK_ORDER:
            out[axis] = rank % self.sizes[axis]
            rank //= self.sizes[axis]
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for axis in RANK_ORDER:
            rank += coords.get(axis, 0) * stride
            stride *= self.sizes[axis]
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: ranks that differ only in their `axis` coordinate.

        Listed in a fixed order, identical on all ranks, as collective group creation requires.
        """
        if axis not in RANK_ORDER:
            raise ValueError(f"unknown axis {axis!r}; expected one of {RANK_ORDER}")
        others = [a for a in RANK_ORDER if a != axis]
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

    @property
    def layout(self) -> Layout:
        """The mesh as a Layout with its dp spelled out."""
        return Layout(**self.sizes)

    def describe(self) -> str:
        """Canonical layout text with dp, e.g. 'tp=2,pp=2,dp=2'."""
        return self.layout.describe()

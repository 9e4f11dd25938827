"""The communicators of a mesh: one per parallel axis, handed down to the layers explicitly."""

from __future__ import annotations

from dataclasses import dataclass

from dist_infer.comm.base import Communicator
from dist_infer.topology.mesh import AXES, Mesh


@dataclass
class ParallelGroups:
    """What a rank needs to know about its groups (Megatron's pg_collection)."""

    world: Communicator
    mesh: Mesh
    tp: Communicator
    cp: Communicator
    ep: Communicator
    dp: Communicator
    pp: Communicator

    @property
    def coords(self) -> dict[str, int]:
        return self.mesh.coords(self.world.rank)

    def by_axis(self) -> dict[str, Communicator]:
        return {axis: getattr(self, axis) for axis in AXES}

    def destroy(self) -> None:
        for comm in self.by_axis().values():
            if comm is not self.world:
                comm.destroy()


def build_groups(world: Communicator, mesh: Mesh) -> ParallelGroups:
    """Collective over `world`: create every axis's groups, in AXES order on every rank."""
    if mesh.world_size != world.size:
        raise ValueError(f"mesh {mesh.describe()} has {mesh.world_size} ranks, the world has {world.size}")
    comms = {}
    for axis in AXES:
        groups = mesh.groups(axis)
        if len(groups) == 1:
            comms[axis] = world  # the axis spans the whole world: reuse it
            continue
        comms[axis] = world.split(groups, axis)
    return ParallelGroups(world=world, mesh=mesh, **comms)

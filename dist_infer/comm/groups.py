"""The communicators of a mesh: one per parallel axis, handed down to the layers explicitly."""

from __future__ import annotations

import socket
import zlib
from dataclasses import dataclass

import torch
from loguru import logger

from dist_infer.comm.base import Communicator
from dist_infer.comm.partials import PartialsCommunicator
from dist_infer.comm.shm import ShmAllReduceCommunicator, shm_supported
from dist_infer.comm.socket_links import SocketLinksCommunicator
from dist_infer.comm.socket_setup import LinksUnavailable
from dist_infer.topology.mesh import RANK_ORDER, Mesh


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
        return {axis: getattr(self, axis) for axis in RANK_ORDER}

    def destroy(self) -> None:
        """Every axis's own group; not the world (its owner's), also where an axis wraps it."""
        for comm in self.by_axis().values():
            if comm is self.world:
                continue
            if isinstance(comm, PartialsCommunicator) and comm.inner is self.world:
                comm.close()
            else:
                comm.destroy()


def node_ids(world: Communicator) -> list[int]:
    """A node identifier for every world rank (a hash of the host name), gathered once."""
    mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
    out = torch.empty(world.size, dtype=torch.int64)
    world.all_gather(out, mine)
    return out.tolist()


SHM_AXES = ("tp", "cp")  # the groups with a small collective per layer of every decode step


SMALL_COLLECTIVES = ("auto", "off", "socket")  # --shm's choices


def build_groups(world: Communicator, mesh: Mesh, shm: str = "auto") -> ParallelGroups:
    """Collective over `world`: create every axis's groups, in RANK_ORDER on every rank.

    How the tp and cp groups' small CPU collectives travel (the tp all-reduces and the cp
    decode's merge of partials, each once or twice per layer). 'auto': a group whose ranks share
    a node through shared memory (comm/shm.py), one that spans nodes over its own TCP links
    (comm/socket_links.py, on gloo: MPI and NCCL have their own small-message paths; where the
    links cannot be connected, the backend's); 'socket': those links for every such group;
    'off': the backend's own collectives.
    """
    if shm not in SMALL_COLLECTIVES:
        raise ValueError(f"shm must be one of {SMALL_COLLECTIVES}, got {shm!r}")
    if mesh.world_size != world.size:
        raise ValueError(f"mesh {mesh.describe()} has {mesh.world_size} ranks, the world has {world.size}")
    comms: dict[str, Communicator] = {}
    for axis in RANK_ORDER:
        groups = mesh.groups(axis)
        if len(groups) == 1:
            comms[axis] = world  # the axis spans the whole world: reuse it
            continue
        comm = world.split(groups, axis)
        if comm is None:  # (a mesh's groups of an axis hold every rank)
            raise ValueError(f"world rank {world.rank} is in none of mesh {mesh.describe()}'s {axis} groups")
        comms[axis] = comm
    shared = [axis for axis in SHM_AXES if comms[axis].size > 1]
    if shm == "socket":
        for axis in shared:
            comms[axis] = SocketLinksCommunicator(comms[axis])
    elif shm == "auto" and shared:
        nodes = dict(zip(world.ranks, node_ids(world)))  # by global rank: `world` may itself be a subgroup
        for axis in shared:
            one_node = len({nodes[r] for r in comms[axis].ranks}) == 1
            if one_node and shm_supported():
                comms[axis] = ShmAllReduceCommunicator(comms[axis])
            elif not one_node and world.backend == "gloo":  # MPI and NCCL have their own small-message paths
                comms[axis] = _links_or_backend(comms[axis])
    return ParallelGroups(world=world, mesh=mesh, **comms)


def _links_or_backend(comm: Communicator) -> Communicator:
    """The group across hosts on its own TCP links, or, where they cannot be connected (every rank
    of it learns so together), on the backend's collectives as before."""
    try:
        return SocketLinksCommunicator(comm, across_hosts=True)
    except LinksUnavailable as exc:
        logger.warning(f"{exc}; the group's small collectives stay on {comm.backend}")
        return comm

"""A group of one process, for a model that runs on one rank beside the job's own groups (the
speculative draft model on an instance's driver): every collective is the identity, done at once,
with no backend behind it (Communicator short-circuits groups of one)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from dist_infer.comm.base import Communicator, DoneHandle, Handle, P2POp
from dist_infer.comm.groups import ParallelGroups
from dist_infer.topology.layout import Layout
from dist_infer.topology.mesh import Mesh


class SoloCommunicator(Communicator):
    backend = "solo"

    def __init__(self, name: str = "solo"):
        super().__init__(0, [0], name)

    def split(self, groups: Sequence[Sequence[int]], name: str) -> Optional[Communicator]:
        return SoloCommunicator(name) if any(0 in g for g in groups) else None

    def _post_all_reduce(self, tensor: torch.Tensor, op: str) -> Handle:
        return DoneHandle()

    def _post_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        output.view(-1).copy_(input.reshape(-1))
        return DoneHandle()

    def _post_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str) -> Handle:
        output.view(-1).copy_(input.reshape(-1))
        return DoneHandle()

    def _post_all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> Handle:
        output.copy_(input)
        return DoneHandle()

    def _post_broadcast(self, tensor: torch.Tensor, src: int) -> Handle:
        return DoneHandle()

    def _post_barrier(self) -> Handle:
        return DoneHandle()

    def _post_p2p(self, ops: list[P2POp]) -> Handle:
        return self._self_p2p(ops)


def solo_groups() -> ParallelGroups:
    """ParallelGroups of one rank on every axis (no tp, pp, cp, ep, dp)."""
    one = SoloCommunicator()
    return ParallelGroups(world=one, mesh=Mesh.build(Layout(), 1), tp=one, cp=one, ep=one, dp=one, pp=one)

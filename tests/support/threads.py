"""Ranks as threads: a Communicator whose collectives meet at a barrier in this process, so a
layer's or the engine's real all-gather / all-to-all / all-reduce / broadcast calls run unchanged
with every rank of a tp x ep mesh on a thread of the test process."""

from __future__ import annotations

import threading

import torch

from dist_infer.comm.base import Communicator, DoneHandle
from dist_infer.comm.groups import ParallelGroups
from dist_infer.topology import Layout, Mesh


class _Meeting:
    """Where the threads of one group exchange values: a barrier before and after reading."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots: list = [None] * size


class ThreadComm(Communicator):
    """A group of threads in this process; collectives are exact and in rank order."""

    backend = "threads"

    def __init__(self, meeting: _Meeting, rank: int, name: str):
        super().__init__(rank, list(range(len(meeting.slots))), name, timeout=30)
        self.meeting = meeting

    def _exchange(self, value):
        m = self.meeting
        m.slots[self.rank] = value
        m.barrier.wait()
        values = list(m.slots)
        m.barrier.wait()
        return values

    def _post_all_reduce(self, tensor, op):
        values = self._exchange(tensor.clone())
        total = values[0].clone()
        for v in values[1:]:
            total += v
        tensor.copy_(total)
        return DoneHandle()

    def _post_all_gather(self, output, input):
        values = self._exchange(input.clone())
        output.view(-1).copy_(torch.cat([v.reshape(-1) for v in values]))
        return DoneHandle()

    def _post_all_to_all(self, output, input, out_splits, in_splits):
        values = self._exchange([p.clone() for p in input.split(in_splits)])
        output.copy_(torch.cat([values[src][self.rank] for src in range(self.size)]))
        return DoneHandle()

    def _post_broadcast(self, tensor, src):  # the engine's step plans
        values = self._exchange(tensor.clone())
        tensor.copy_(values[src])
        return DoneHandle()

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("ThreadComm only does what the MoE layer and the engine need")

    _post_reduce_scatter = _post_barrier = _post_p2p = split = _unsupported


def thread_groups(tp: int, ep: int) -> list[ParallelGroups]:
    """ParallelGroups for the ranks of a tp x ep mesh, index = mesh rank (tp fastest)."""
    mesh = Mesh.build(Layout(tp=tp, ep=ep), tp * ep)
    single = [_Meeting(1) for _ in range(tp * ep)]
    tp_meet = {e: _Meeting(tp) for e in range(ep)}
    ep_meet = {t: _Meeting(ep) for t in range(tp)}
    world = _Meeting(tp * ep)
    out = []
    for r in range(tp * ep):
        c = mesh.coords(r)
        one = ThreadComm(single[r], 0, "one")
        out.append(
            ParallelGroups(
                world=ThreadComm(world, r, "world"),
                mesh=mesh,
                tp=ThreadComm(tp_meet[c["ep"]], c["tp"], "tp"),
                cp=one,
                ep=ThreadComm(ep_meet[c["tp"]], c["ep"], "ep"),
                dp=one,
                pp=one,
            )
        )
    return out


def run_ranks(groups: list[ParallelGroups], body):
    """body(groups) on one thread per rank; returns the results in rank order, re-raising any error."""
    results, errors = [None] * len(groups), []

    def target(r):
        try:
            with torch.inference_mode():
                results[r] = body(groups[r])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            for g in {id(x.meeting): x.meeting for x in (groups[r].tp, groups[r].ep, groups[r].world)}.values():
                g.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results

"""Every rank of one instance in this process, one at a time, for tensors without values.

`FakeWorld` holds the ranks' mailboxes; `FakeComm` is a Communicator on it. Fake (device)
tensors carry no values, so their collectives only check what a real backend would refuse (the
two sides of a collective or of a send/receive on different devices: NCCL takes CUDA tensors,
gloo CPU ones, and a pair that disagrees hangs or fails) and leave the data as it is. Host
tensors (step plans, sampled tokens) do travel: a broadcast or send is kept in the receiver's
mailbox until the receiver runs. Ranks run one at a time: a receive with nothing waiting asks the
sender to run first (`pumps[rank]()` runs one step plan on that rank), so the driver can wait for
its last pipeline stage's tokens in the same thread. `FakeLink` is a PeerLink for KV migration
that moves nothing but keeps the link's contract (a sent tensor goes to the host; a received
one arrives through a host staging buffer).
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Callable, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from dist_infer.comm.base import CommError, Communicator, DoneHandle, P2POp
from dist_infer.comm.groups import ParallelGroups
from dist_infer.comm.peer.recv_handle import RecvHandle
from dist_infer.engine.kv_transfer import ACK
from dist_infer.topology import RANK_ORDER, Layout, Mesh


class DeviceMismatch(CommError):
    """The two sides of a collective or a send/receive hold tensors on different devices."""


class FakeWorld:
    def __init__(self, size: int):
        self.size = size
        self.mail: dict[tuple, deque] = defaultdict(deque)  # (src, dst, channel) -> tensors, global ranks
        self.pumps: dict[int, Callable[[], bool]] = {}

    def post(self, src: int, dst: int, channel: tuple, tensor: torch.Tensor) -> None:
        self.mail[(src, dst, channel)].append(tensor if isinstance(tensor, FakeTensor) else tensor.clone())

    def take(self, src: int, dst: int, channel: tuple) -> Optional[torch.Tensor]:
        box = self.mail[(src, dst, channel)]
        pump = self.pumps.get(src)
        while not box and pump is not None and pump():
            pass
        return box.popleft() if box else None

    def waiting(self, dst: int, channel: tuple) -> bool:
        return any(box for (s, d, c), box in self.mail.items() if d == dst and c == channel)


def _same_device(op: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise DeviceMismatch(f"{op}: tensors on {sorted(map(str, devices))}")


class FakeComm(Communicator):
    """A group of the fake world; `ranks` are global ranks, `rank` this process's index in them."""

    backend = "fake"

    def __init__(self, world: FakeWorld, rank: int, ranks: Sequence[int], name: str):
        super().__init__(rank, ranks, name, timeout=5)
        self.world = world

    def _deliver(self, src: int, channel: tuple, tensor: torch.Tensor, op: str) -> None:
        """`tensor` receives what group rank `src` sent on `channel` (fake buffers may get nothing)."""
        got = self.world.take(self.ranks[src], self.global_rank, channel)
        if got is None:
            if isinstance(tensor, FakeTensor):
                return  # nobody ran the sender yet; the values would not exist anyway
            raise CommError(f"{self.describe(op)}: nothing from rank {self.ranks[src]} on {channel}")
        if got.device != tensor.device:
            raise DeviceMismatch(
                f"{self.describe(op)}: rank {self.ranks[src]} sent a {got.device} tensor, "
                f"rank {self.global_rank} receives into a {tensor.device} one"
            )
        if got.numel() != tensor.numel() or got.dtype != tensor.dtype:
            raise CommError(
                f"{self.describe(op)}: sent {got.numel()} {got.dtype}, receiving {tensor.numel()} {tensor.dtype}"
            )
        tensor.copy_(got.reshape(tensor.shape))

    def _post_broadcast(self, tensor, src):
        if self.rank == src:
            for r in self.ranks:
                if r != self.global_rank:
                    self.world.post(self.global_rank, r, ("bcast", self.name), tensor)
        else:
            self._deliver(src, ("bcast", self.name), tensor, "broadcast")
        return DoneHandle()

    def _post_all_reduce(self, tensor, op):
        return DoneHandle()  # every rank's values are the same or unknown: the sum is not checked

    def _post_all_gather(self, output, input):
        _same_device(self.describe("all_gather"), output, input)
        output.view(self.size, -1).copy_(input.reshape(1, -1).expand(self.size, -1))
        return DoneHandle()

    def _post_reduce_scatter(self, output, input, op):
        _same_device(self.describe("reduce_scatter"), output, input)
        output.view(-1).copy_(input.reshape(self.size, -1)[self.rank])
        return DoneHandle()

    def _post_all_to_all(self, output, input, out_splits, in_splits):
        _same_device(self.describe("all_to_all"), output, input)
        if not isinstance(output, FakeTensor):
            raise CommError(f"{self.describe('all_to_all')}: host all-to-alls are not simulated")
        return DoneHandle()

    def _post_barrier(self):
        return DoneHandle()

    def _post_p2p(self, ops: list[P2POp]):
        _same_device(self.describe("batch_isend_irecv"), *[o.tensor for o in ops])
        for o in ops:
            channel = ("p2p", self.name, o.tag)
            if o.kind == "send":
                self.world.post(self.global_rank, self.ranks[o.peer], channel, o.tensor)
            else:
                self._deliver(o.peer, channel, o.tensor, "recv")
        return DoneHandle()

    def split(self, groups, name):
        for g in groups:
            if self.rank in g:
                return FakeComm(self.world, list(g).index(self.rank), [self.ranks[r] for r in g], name)
        return None


def fake_groups(layout: Layout) -> tuple[FakeWorld, list[ParallelGroups]]:
    """The world and every rank's groups (index = world rank) of `layout` on one fake world."""
    size = 1
    for axis in RANK_ORDER:
        size *= getattr(layout, axis, 1) or 1
    mesh = Mesh.build(layout, size)
    world = FakeWorld(size)
    out = []
    for r in range(size):
        comms = {}
        for axis in RANK_ORDER:
            ranks = mesh.group_of(axis, r)
            comms[axis] = FakeComm(world, ranks.index(r), ranks, axis)
        out.append(ParallelGroups(world=FakeComm(world, r, range(size), "world"), mesh=mesh, **comms))
    return world, out


class FakeLink:
    """A PeerLink that carries nothing between instances, shared by every rank of one.

    `send` takes a tensor on any device to the host, as the real link does before writing it to
    its socket. A receive of KV blocks (from the other instance, which does not exist here)
    completes at once with zeros through the real RecvHandle, whose host staging buffer is copied
    into the (device) destination on wait. A follower's "my share is in" message to the driver
    does travel: it is matched with the driver's receive of the same key, whichever comes first."""

    def __init__(self, timeout: float = 5.0):
        self.timeout = timeout
        self.sent: list[tuple[tuple, torch.Tensor]] = []
        self.received: list[tuple] = []  # keys of the KV receives completed
        self._acks: dict[tuple, object] = {}  # key -> the waiting RecvHandle or the host tensor sent

    def send(self, tensor: torch.Tensor, peer, key) -> None:
        host = tensor.detach().contiguous().cpu()
        self.sent.append((tuple(key), host))
        if key[2] >= ACK:
            waiting = self._acks.pop(tuple(key), None)
            if waiting is None:
                self._acks[tuple(key)] = host
            else:
                self._fill(waiting, host)

    def irecv(self, tensor: torch.Tensor, peer, key, on_done=None) -> RecvHandle:
        handle = RecvHandle(self, tuple(key), tensor, peer, on_done)
        if key[2] < ACK:
            self.received.append(tuple(key))
            self._fill(handle, None)
        elif isinstance(self._acks.get(tuple(key)), torch.Tensor):
            self._fill(handle, self._acks.pop(tuple(key)))
        else:
            self._acks[tuple(key)] = handle
        return handle

    @staticmethod
    def _fill(handle: RecvHandle, host: Optional[torch.Tensor]) -> None:
        if host is None:
            handle.staging.zero_()
        else:
            handle.staging.copy_(host.reshape(handle.staging.shape))
        handle.finish()

    def drop(self, migration_id: int) -> None:
        pass

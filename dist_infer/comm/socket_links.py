"""Small CPU collectives over the group's own TCP links, for groups whose ranks are on different hosts.

gloo's all-reduce of a decode step's few kilobytes costs about as much as a layer's compute on
a CPU (it hands each op to its own thread and runs a ring of steps: docs/benchmarks.md, "The
group's own TCP links"), and a tensor-parallel group does two a layer. A plain exchange over one
socket per pair of ranks is an order of magnitude cheaper, and split in two like the shared
segment's (comm/partials.py) it needs no thread at all:
  post:  send (sequence number, byte count, bytes) to every other rank. A decode's partial fits
         the kernel's socket buffer, so this returns at once; the kernel moves the bytes while
         the caller computes.
  wait:  read each peer's message for this op (messages of later ops that come first are kept
         for their own waits), then combine the partials in rank order.
A send that does not fit the buffer reads what the peers sent meanwhile, so two ranks sending
to each other can never both block.

The links are connected by comm/socket_setup.py (a random key, the job's address, closed to
newcomers once the group is in). A rank never has more bytes posted and not yet waited for than
half of what the kernel buffers between two ranks: beyond that, it first finishes its oldest op,
so a post cannot block on a peer that is busy in another collective. Every wait has the group's
timeout; a peer's link closing fails the op with its rank named.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections import OrderedDict
from typing import Optional

import torch

from dist_infer.comm.base import CommError, CommTimeoutError, Communicator
from dist_infer.comm.partials import PartialsCommunicator, PartialsHandle, combine_partials
from dist_infer.comm.socket_setup import connect_group, job_address

MAX_BYTES = 1 << 20  # the most a rank sends per op (over all its links); larger tensors go to the inner communicator
SPIN_S = 2e-4  # how long a wait polls its socket before it sleeps in poll()
_HEADER = struct.Struct("<qq")  # sequence number, payload bytes
_SOCKET_BUFFER = 2 << 20  # asked of the kernel for each direction of a link (it may grant less)


class _Link:
    """One peer's socket and the messages read from it ahead of their waits."""

    def __init__(self, sock: socket.socket, peer: int):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # bounded (the kernel may cap it lower), not autotuned
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        sock.setblocking(False)
        self.sock, self.peer = sock, peer
        self._poll = select.poll()  # poll, not select: a serving process may hold descriptors past 1024
        self._poll.register(sock, select.POLLIN)
        self.buffer = bytearray(_HEADER.size + MAX_BYTES)  # bytes read, not yet a whole message
        self.view = memoryview(self.buffer)
        self.filled = 0
        self.arrived: dict[int, bytearray] = {}  # whole messages by sequence number

    def wait_readable(self, timeout_s: float) -> None:
        self._poll.poll(max(1, int(timeout_s * 1000)))

    def read_available(self) -> bool:
        """Read what the socket holds into whole messages; False when nothing was there."""
        try:
            got = self.sock.recv_into(self.view[self.filled :])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            raise CommError(f"the link to group rank {self.peer} failed: {exc}") from None
        if not got:
            raise CommError(f"group rank {self.peer} closed its link (the rank ended)")
        self.filled += got
        start = 0
        while self.filled - start >= _HEADER.size:
            seq, nbytes = _HEADER.unpack_from(self.buffer, start)
            if nbytes < 0 or nbytes > MAX_BYTES:
                raise CommError(f"group rank {self.peer} sent a message of {nbytes} bytes (at most {MAX_BYTES})")
            end = start + _HEADER.size + nbytes
            if end > self.filled:
                break
            self.arrived[seq] = self.buffer[start + _HEADER.size : end]  # a copy, writable for frombuffer
            start = end
        if start:  # keep the partial message at the front (at most one message's bytes)
            self.view[: self.filled - start] = self.view[start : self.filled]
            self.filled -= start
        return True


class SocketLinksCommunicator(PartialsCommunicator):
    """`inner`, with small CPU all-reduces, all-gathers and reduce-scatters over a TCP link per
    pair of ranks. `across_hosts`: the group spans hosts, so a loopback address is no use (the
    set-up then fails on every rank together: LinksUnavailable)."""

    def __init__(self, inner: Communicator, address: Optional[str] = None, across_hosts: bool = False):
        super().__init__(inner)
        self._seq = 0
        self._unfinished: OrderedDict[int, tuple[PartialsHandle, torch.Tensor]] = OrderedDict()  # with my part
        self._unfinished_bytes = 0
        socks = connect_group(inner, address or job_address(), across_hosts, self.describe("socket links"))
        self._links = {peer: _Link(sock, peer) for peer, sock in sorted(socks.items())}
        self._poll = select.poll()
        for link in self._links.values():
            self._poll.register(link.sock, select.POLLIN)
        self._by_fd = {link.sock.fileno(): link for link in self._links.values()}
        self.budget = self._agreed_budget()
        self.max_bytes = min(MAX_BYTES // max(1, self.size - 1), self.budget)

    def _agreed_budget(self) -> int:
        """Half the payload the kernel holds between two ranks (its send and receive buffers, of
        which it reports twice what it grants data), the same on every rank: what this rank's
        unfinished ops may hold, so that everything a peer has not yet read fits its buffers
        (its own unfinished ops and mine that it has not posted yet: twice the budget at most)."""
        held = min(
            (
                (
                    link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                    + link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
                )
                // 2
                for link in self._links.values()
            ),
            default=MAX_BYTES,
        )
        agreed = torch.tensor([held // 2], dtype=torch.int64)
        self.inner.all_reduce(agreed, op="min")
        return int(agreed.item())

    # -- ops ---------------------------------------------------------------------------
    def _post(
        self, tensor: torch.Tensor, gather_into: Optional[torch.Tensor], scatter_into: Optional[torch.Tensor] = None
    ) -> PartialsHandle:
        mine = tensor.detach().reshape(-1).clone()  # this rank's part as posted (the caller may reuse `tensor`)
        nbytes = mine.numel() * mine.element_size()
        while self._unfinished and self._unfinished_bytes + nbytes > self.budget:
            next(iter(self._unfinished.values()))[0].wait()  # the oldest first (its peers posted it before)
        self._seq += 1
        seq = self._seq
        payload = mine.view(torch.uint8).numpy().data  # (a memoryview of its buffer)
        header = _HEADER.pack(seq, nbytes)
        deadline = time.monotonic() + self.timeout
        for link in self._links.values():
            try:
                sent = link.sock.sendmsg([header, payload])  # both in one call, no copy (the usual case)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise CommError(f"{self.describe('send')}: the link to group rank {link.peer} failed: {exc}") from None
            if sent < len(header) + nbytes:
                self._send(link, memoryview(header + payload.tobytes())[sent:], deadline)
        handle = PartialsHandle(self, seq, tensor, gather_into, scatter_into)
        self._unfinished[seq] = (handle, mine)
        self._unfinished_bytes += nbytes
        return handle

    def _send(self, link: _Link, data: memoryview, deadline: float) -> None:
        """The rest of a message that did not fit the buffer: meanwhile read what the peers send
        (they may be blocked sending to this rank)."""
        while data:
            try:
                data = data[link.sock.send(data) :]
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise CommError(f"{self.describe('send')}: the link to group rank {link.peer} failed: {exc}") from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeoutError(
                    f"{self.describe('send')} to group rank {link.peer} did not complete within {self.timeout:.0f} s"
                )
            self._poll.modify(link.sock, select.POLLIN | select.POLLOUT)
            try:
                ready = self._poll.poll(min(left, 1.0) * 1000)
            finally:
                self._poll.modify(link.sock, select.POLLIN)
            for fd, events in ready:
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    self._by_fd[fd].read_available()

    def _combine(
        self,
        seq: int,
        tensor: torch.Tensor,
        gather_into: Optional[torch.Tensor],
        timeout: float,
        scatter_into: Optional[torch.Tensor] = None,
    ) -> None:
        deadline = time.monotonic() + timeout
        mine = self._unfinished[seq][1]
        parts: list[torch.Tensor] = []
        for r in range(self.size):
            if r == self.rank:
                parts.append(mine)
                continue
            data = self._message(self._links[r], seq, deadline, timeout)
            if len(data) != mine.numel() * mine.element_size():
                raise CommError(
                    f"{self.describe('collective')}: group rank {r} sent {len(data)} bytes for op {seq}, "
                    f"this rank posted {mine.numel() * mine.element_size()} (the ranks' ops differ)"
                )
            parts.append(torch.frombuffer(data, dtype=mine.dtype))
        combine_partials(parts, self.rank, tensor, gather_into, scatter_into)
        self._unfinished.pop(seq)
        self._unfinished_bytes -= mine.numel() * mine.element_size()

    def _message(self, link: _Link, seq: int, deadline: float, timeout: float) -> bytearray:
        """Peer's part of op `seq`: polled for up to SPIN_S (the peer is usually that close, and a
        sleeping reader's wake-up costs more than the exchange), then slept for in poll()."""
        spin_until = time.monotonic() + SPIN_S
        while seq not in link.arrived:
            if link.read_available():
                continue
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()
                continue
            left = deadline - now
            if left <= 0:
                raise CommTimeoutError(
                    f"{self.describe('collective')}: group rank {link.peer}'s part of op {seq} "
                    f"did not come within {timeout:.0f} s"
                )
            link.wait_readable(left)
        return link.arrived.pop(seq)

    def close(self) -> None:
        for link in self._links.values():
            try:
                link.sock.close()
            except OSError:
                pass
        self._links.clear()
        self._by_fd.clear()

    def destroy(self) -> None:
        self.close()
        super().destroy()

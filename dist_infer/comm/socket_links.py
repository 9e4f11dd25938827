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

Set-up is collective over the inner communicator: each rank but the last listens on its address
on the job's network (the one that routes to MASTER_ADDR, never the wildcard), the group's
addresses and a random key from its first rank go round, and every rank dials the ranks before
it and proves the key. A listener takes only its expected peers, gives each connection seconds
to prove itself, and is closed as soon as they are in. Every wait has the group's timeout; a
peer's link closing fails the op with its rank named.
"""

from __future__ import annotations

import hmac
import os
import secrets
import select
import socket
import struct
import time
from typing import Optional

import torch

from dist_infer.comm.base import CommError, CommTimeoutError, Communicator
from dist_infer.comm.partials import PartialsCommunicator, PartialsHandle, combine_partials
from dist_infer.topology.network import local_address_towards

MAX_BYTES = 256 * 1024  # larger tensors go to the inner communicator (bandwidth, not latency, bound)
MAX_UNFINISHED = 16  # posted ops not yet waited; the oldest is finished before one more is posted
HELLO = b"dist-infer/links1"  # + the group's key + the dialer's group rank
_HEADER = struct.Struct("<qq")  # sequence number, payload bytes
_KEY_BYTES = 32
SPIN_S = 2e-4  # how long a wait polls its socket before it sleeps in select
_SOCKET_BUFFER = 1 << 18  # asked of the kernel for each direction of a link
_HELLO_S = 5.0  # how long a connection has to prove the key
_MAX_STRANGERS = 64  # connections that fail the handshake before set-up gives up


def job_address() -> str:
    """This rank's address on the job's network: the one that routes to MASTER_ADDR (loopback
    for a one-host job without one)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        return local_address_towards(socket.gethostbyname(master))
    except OSError:
        return "127.0.0.1"


class _Link:
    """One peer's socket and the messages read from it ahead of their waits."""

    def __init__(self, sock: socket.socket, peer: int):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # bounded (the kernel caps it lower still), not autotuned
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
        sock.setblocking(False)
        self.sock, self.peer = sock, peer
        self.buffer = bytearray(_HEADER.size + MAX_BYTES)  # bytes read, not yet a whole message
        self.view = memoryview(self.buffer)
        self.filled = 0
        self.arrived: dict[int, bytes] = {}  # whole messages by sequence number

    def read_available(self) -> bool:
        """Read what the socket holds into whole messages; False when nothing was there."""
        try:
            got = self.sock.recv_into(self.view[self.filled:])
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
            self.arrived[seq] = bytes(self.view[start + _HEADER.size:end])
            start = end
        if start:  # keep the partial message at the front (at most one message's bytes)
            self.view[:self.filled - start] = self.view[start:self.filled]
            self.filled -= start
        return True


class SocketLinksCommunicator(PartialsCommunicator):
    """`inner`, with small CPU all-reduces, all-gathers and reduce-scatters over a TCP link per pair of ranks."""

    def __init__(self, inner: Communicator, address: Optional[str] = None, max_bytes: int = MAX_BYTES):
        super().__init__(inner)
        self.max_bytes = min(max_bytes, MAX_BYTES)
        self._seq = 0
        self._unfinished: dict[int, PartialsHandle] = {}
        self._links: dict[int, _Link] = {}
        self._connect(address or job_address())

    # -- set-up ------------------------------------------------------------------------
    def _connect(self, address: str) -> None:
        listener = None
        if self.rank < self.size - 1:
            listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((address, 0))
            listener.listen(self.size)
        try:
            where = self._exchange(address, listener.getsockname()[1] if listener else 0)
            key = self._group_key()
            deadline = time.monotonic() + self.timeout
            for peer in range(self.rank):
                self._dial(peer, where[peer], key, deadline)
            if listener is not None:
                self._accept(listener, key, deadline)
        except BaseException:
            self.close()
            raise
        finally:
            if listener is not None:
                listener.close()

    def _exchange(self, address: str, port: int) -> list[tuple[str, int]]:
        """Every group rank's (address, port), through the inner communicator."""
        mine = torch.zeros(64, dtype=torch.uint8)
        text = f"{address} {port}".encode()
        mine[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        every = torch.empty(self.size * 64, dtype=torch.uint8)
        self.inner.all_gather(every, mine)
        out = []
        for r in range(self.size):
            host, port_text = bytes(every[r * 64:(r + 1) * 64].tolist()).rstrip(b"\0").decode().split(" ")
            out.append((host, int(port_text)))
        return out

    def _group_key(self) -> bytes:
        key = torch.tensor(list(secrets.token_bytes(_KEY_BYTES)), dtype=torch.uint8)
        self.inner.broadcast(key, src=0)
        return bytes(key.tolist())

    def _dial(self, peer: int, where: tuple[str, int], key: bytes, deadline: float) -> None:
        try:
            sock = socket.create_connection(where, timeout=max(0.1, deadline - time.monotonic()))
            sock.sendall(HELLO + key + struct.pack("<i", self.rank))
        except OSError as exc:
            raise CommError(f"{self.describe('socket links')}: cannot reach group rank {peer} at "
                            f"{where[0]}:{where[1]}: {exc}") from None
        self._links[peer] = _Link(sock, peer)

    def _accept(self, listener: socket.socket, key: bytes, deadline: float) -> None:
        """Take every later rank's connection; anything that does not prove the key is closed."""
        expected, strangers = set(range(self.rank + 1, self.size)), 0
        want = len(HELLO) + _KEY_BYTES + 4
        while expected:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeoutError(f"{self.describe('socket links')}: group ranks {sorted(expected)} did not "
                                       f"connect within {self.timeout:.0f} s")
            listener.settimeout(left)
            try:
                sock, _ = listener.accept()
            except socket.timeout:
                continue
            peer = _hello(sock, key, want, min(_HELLO_S, max(0.1, left)))
            if peer in expected:
                expected.discard(peer)
                self._links[peer] = _Link(sock, peer)
                continue
            sock.close()
            strangers += 1
            if strangers >= _MAX_STRANGERS:
                raise CommError(f"{self.describe('socket links')}: {strangers} connections failed the handshake")

    # -- ops ---------------------------------------------------------------------------
    def _post(self, tensor: torch.Tensor, gather_into: Optional[torch.Tensor],
              scatter_into: Optional[torch.Tensor] = None) -> PartialsHandle:
        self._seq += 1
        seq = self._seq
        oldest = seq - MAX_UNFINISHED
        if oldest in self._unfinished:  # bound what sits unread in the peers' buffers
            self._unfinished[oldest].wait()
        payload = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        header = _HEADER.pack(seq, len(payload))
        deadline = time.monotonic() + self.timeout
        for link in self._links.values():
            try:
                sent = link.sock.sendmsg([header, payload])  # both in one call, no copy (the usual case)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise CommError(f"{self.describe('send')}: the link to group rank {link.peer} failed: {exc}") from None
            if sent < len(header) + len(payload):
                self._send(link, memoryview(header + payload.tobytes())[sent:], deadline)
        handle = PartialsHandle(self, seq, tensor, gather_into, scatter_into)
        self._unfinished[seq] = handle
        return handle

    def _send(self, link: _Link, data: memoryview, deadline: float) -> None:
        while data:
            try:
                sent = link.sock.send(data)
                data = data[sent:]
                continue
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                raise CommError(f"{self.describe('send')}: the link to group rank {link.peer} failed: {exc}") from None
            # the buffer is full: read what the peers sent meanwhile (they may be blocked sending to us)
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeoutError(f"{self.describe('send')} to group rank {link.peer} did not complete "
                                       f"within {self.timeout:.0f} s")
            readable, _, _ = select.select([x.sock for x in self._links.values()], [link.sock], [], min(left, 1.0))
            for other in self._links.values():
                if other.sock in readable:
                    other.read_available()

    def _finish(self, seq: int, tensor: torch.Tensor, gather_into: Optional[torch.Tensor], timeout: float,
                scatter_into: Optional[torch.Tensor] = None) -> None:
        deadline = time.monotonic() + timeout
        nbytes = tensor.numel() * tensor.element_size()
        parts: list[torch.Tensor] = []
        for r in range(self.size):
            if r == self.rank:
                parts.append(tensor.view(-1) if gather_into is None else tensor.reshape(-1))
                continue
            data = self._message(self._links[r], seq, deadline, timeout)
            if len(data) != nbytes:
                raise CommError(f"{self.describe('all_reduce')}: group rank {r} sent {len(data)} bytes for op {seq}, "
                                f"this rank posted {nbytes} (the ranks' ops differ)")
            parts.append(torch.frombuffer(bytearray(data), dtype=tensor.dtype))
        if gather_into is None and scatter_into is None:
            parts[self.rank] = parts[self.rank].clone()  # the sum is written over this rank's tensor
        combine_partials(parts, self.rank, tensor, gather_into, scatter_into)
        self._unfinished.pop(seq, None)

    def _message(self, link: _Link, seq: int, deadline: float, timeout: float) -> bytes:
        """Peer's part of op `seq`: polled for up to SPIN_S (the peer is usually that close, and a
        sleeping reader's wake-up costs more than the exchange), then slept for in select."""
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
                raise CommTimeoutError(f"{self.describe('all_reduce')}: group rank {link.peer}'s part of op {seq} "
                                       f"did not come within {timeout:.0f} s")
            select.select([link.sock], [], [], left)
        return link.arrived.pop(seq)

    def close(self) -> None:
        for link in self._links.values():
            try:
                link.sock.close()
            except OSError:
                pass
        self._links.clear()

    def destroy(self) -> None:
        self.close()
        super().destroy()


def _hello(sock: socket.socket, key: bytes, want: int, limit: float) -> int:
    """The group rank a new connection proves it is, or -1 (wrong key, too slow, garbage)."""
    sock.settimeout(limit)
    got = b""
    try:
        while len(got) < want:
            chunk = sock.recv(want - len(got))
            if not chunk:
                return -1
            got += chunk
    except OSError:
        return -1
    if got[:len(HELLO)] != HELLO or not hmac.compare_digest(got[len(HELLO):len(HELLO) + _KEY_BYTES], key):
        return -1
    return struct.unpack("<i", got[-4:])[0]

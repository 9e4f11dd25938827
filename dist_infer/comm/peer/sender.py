"""The peer link's sending side and wire format: one connection per receiver, dialled and
authenticated on first use, each message a header (key, byte count) and the tensor's bytes.

Kept apart from the receiving side (comm/peer/link.py) because the two share no state: a send
needs only a live, authenticated socket to the receiver's address. The receiver never writes
after the handshake except to say it is closing the connection (idle, or evicted to make room
for another sender), so a connection with anything to read is dropped and dialled anew before
the next message goes out, rather than written into a socket the receiver no longer reads.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from dist_infer.comm.base import CommError, DoneHandle, Handle
from dist_infer.comm.peer.auth import Address, HandshakeError, client_handshake

Key = tuple[int, int, int]
HEADER = struct.Struct("!qqqq")  # key (3), payload bytes


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype: numpy has no bfloat16)."""
    return tensor.reshape(-1).view(torch.uint8)


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of a device tensor (through pinned memory from CUDA), or the host tensor itself."""
    if tensor.device.type == "cpu":
        return tensor.contiguous()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor)
    return host


def fmt(address: Optional[Address]) -> str:
    """host:port, for messages ('?': a connection not admitted yet, whose sender is not known)."""
    return "?" if address is None else f"{address[0]}:{address[1]}"


class PeerLinkError(CommError):
    """A peer could not be reached, or a message did not match the receive posted for it."""


class _FailedHandle(Handle):
    def __init__(self, error: Exception):
        self.error = error

    def wait(self, timeout: Optional[float] = None) -> None:
        raise self.error

    def is_completed(self) -> bool:
        return True


@dataclass
class Outbound:
    """One outgoing connection; `last` is when it last carried a message."""

    sock: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    last: float = field(default_factory=time.monotonic)

    def stale(self, max_idle: float) -> bool:
        """The receiver closes connections idle for its idle timeout; a send into a socket it has
        closed would vanish, so a connection idle for half that, or closed by it, is made anew."""
        if time.monotonic() - self.last > max_idle:
            return True
        poller = select.poll()  # readable: the receiver closed it, or said it is about to
        poller.register(self.sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(0))


class Outbounds:
    """The connections from the link at `address` to its peers (made, reused, forgotten)."""

    def __init__(self, key: bytes, address: Address, timeout: float, handshake_timeout: float, idle_timeout: float):
        self.key, self.address, self.timeout, self.handshake_timeout = key, address, timeout, handshake_timeout
        self.idle_timeout = idle_timeout  # the receivers'
        self._lock = threading.Lock()
        self._out: dict[Address, Outbound] = {}
        self._connecting: dict[Address, threading.Lock] = {}

    def _dial(self, peer: Address) -> socket.socket:
        """Connect and authenticate; a listener that is full closes new connections unanswered,
        so those are tried again (briefly backing off) until the link's timeout."""
        deadline, delay = time.monotonic() + self.timeout, 0.05
        while True:
            try:
                sock = socket.create_connection(peer, timeout=self.timeout, source_address=(self.address[0], 0))
            except OSError:  # our address may not route there: let the kernel choose the source
                sock = socket.create_connection(peer, timeout=self.timeout)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                client_handshake(sock, self.key, self.address, peer, self.handshake_timeout)
                sock.settimeout(self.timeout)
                return sock
            except HandshakeError:
                sock.close()
                raise
            except (OSError, EOFError):
                sock.close()
                if time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 0.5)

    def get(self, peer: Address) -> Outbound:
        """The one connection to `peer`, made on first use (one thread makes it; the others wait)."""
        with self._lock:
            entry = self._out.get(peer)
            connecting = self._connecting.setdefault(peer, threading.Lock())
        if entry is not None:
            return entry
        if not connecting.acquire(timeout=self.timeout + self.handshake_timeout):
            raise TimeoutError("another thread is still connecting")
        try:
            with self._lock:
                entry = self._out.get(peer)
            if entry is None:
                entry = Outbound(self._dial(peer))
                with self._lock:
                    self._out[peer] = entry
            return entry
        finally:
            connecting.release()

    def forget(self, peer: Address, entry: Outbound) -> None:
        with self._lock:
            if self._out.get(peer) is entry:  # only ours: another thread may have made a new one
                del self._out[peer]
        entry.sock.close()

    def send(self, tensor: torch.Tensor, peer: Address, key: Key) -> None:
        """Send now (returns once the bytes are with the kernel); PeerLinkError if the peer is gone."""
        data = as_bytes(_on_host(tensor.detach()))
        entry = None
        try:
            for _ in range(2):
                entry = self.get(peer)
                with entry.lock:
                    if entry.stale(self.idle_timeout / 2):
                        self.forget(peer, entry)
                        continue
                    entry.sock.sendall(HEADER.pack(*key, data.numel()))
                    entry.sock.sendall(data.numpy().data)  # (the array's buffer, as a memoryview)
                    entry.last = time.monotonic()
                    return
            raise ConnectionError("no fresh connection")
        except (OSError, EOFError) as exc:
            if entry is not None:
                self.forget(peer, entry)
            raise PeerLinkError(f"peer link: sending {key} to {fmt(peer)} failed: {exc}") from None

    def isend(self, tensor: torch.Tensor, peer: Address, key: Key) -> Handle:
        """`send`, with a failure kept in the handle (raised on wait) as a communicator's isend does."""
        try:
            self.send(tensor, peer, key)
        except PeerLinkError as exc:
            return _FailedHandle(exc)
        return DoneHandle()

    def close(self) -> None:
        with self._lock:
            outs, self._out = list(self._out.values()), {}
        for entry in outs:
            try:
                entry.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            entry.sock.close()

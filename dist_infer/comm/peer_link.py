"""Tagged tensor messages between processes that share no communicator.

Serving instances are separate jobs that come and go: one dies, another is restarted or added
while the rest serve on. A collective communicator cannot take a new member or survive a dead
one, so the KV blocks of a migrating request travel over this instead: every rank listens on
one TCP port, a sender connects to the receiver's advertised address on first use, and each
message carries a key (three integers: migration, stage, sending rank) that the receiver
matches against the receives it has posted. A message that arrives before its receive is
posted waits in memory; a receive posted for a key whose data is already in completes at once.

Nothing here blocks forever: sends and connects have a timeout, a receive's `wait` has one, and
a connection that closes fails the receives still expecting data from that sender's address.
Receives can take a callback (run on the reader thread) so a rank that is not stepping, such
as an idle follower, still reacts the moment its data is in.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Callable, Optional

import torch
from loguru import logger

from dist_infer.comm.base import CommError, CommTimeoutError, DoneHandle, Handle

Key = tuple[int, int, int]
Address = tuple[str, int]
_HEADER = struct.Struct("!qqqq")  # key (3), payload bytes
_HELLO = struct.Struct("!I")  # length of the JSON hello that names the sender's own address


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype: numpy has no bfloat16)."""
    return tensor.reshape(-1).view(torch.uint8)


class PeerLinkError(CommError):
    """A peer could not be reached, or a message did not match the receive posted for it."""


class _FailedHandle(Handle):
    def __init__(self, error: Exception):
        self.error = error

    def wait(self, timeout: Optional[float] = None) -> None:
        raise self.error

    def is_completed(self) -> bool:
        return True


class RecvHandle(Handle):
    """A posted receive: done when its message is in `tensor` (or failed: `wait` raises)."""

    def __init__(self, link: "PeerLink", key: Key, tensor: torch.Tensor, peer: Address,
                 on_done: Optional[Callable[["RecvHandle"], None]]):
        self.link, self.key, self.tensor, self.peer, self.on_done = link, key, tensor, peer, on_done
        self.staging = tensor if tensor.device.type == "cpu" and tensor.is_contiguous() else \
            torch.empty(tensor.shape, dtype=tensor.dtype)
        self.error: Optional[Exception] = None
        self._event = threading.Event()

    def _finish(self, error: Optional[Exception] = None) -> None:
        if self._event.is_set():
            return
        self.error = error
        self._event.set()
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception as exc:  # noqa: BLE001 - a callback must not kill the reader thread
                logger.warning(f"peer link: receive callback for {self.key} failed: {exc}")

    def is_completed(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> None:
        limit = self.link.timeout if timeout is None else timeout
        if not self._event.wait(limit):
            raise CommTimeoutError(f"peer link: no message {self.key} from {self.peer[0]}:{self.peer[1]} "
                                   f"within {limit:g} s")
        if self.error is not None:
            raise self.error
        if self.staging is not self.tensor:
            self.tensor.copy_(self.staging)


class PeerLink:
    """This process's endpoint: `address` is what peers send to; `isend`/`irecv` as in a
    communicator, but peers are addresses, not ranks, and tags are keys."""

    def __init__(self, host: str = "127.0.0.1", timeout: float = 30.0):
        self.timeout = timeout
        self._server = socket.create_server((host, 0), backlog=64)
        self.address: Address = (host, self._server.getsockname()[1])
        self._lock = threading.Lock()
        self._arrived: dict[Key, bytearray] = {}
        self._posted: dict[Key, RecvHandle] = {}
        self._dropped: set[int] = set()  # first key parts whose messages are no longer wanted
        self._gone: set[Address] = set()  # senders whose every connection closed
        self._incoming: dict[Address, int] = {}  # open connections from each sender
        self._out: dict[Address, tuple[socket.socket, threading.Lock]] = {}
        self._connecting: dict[Address, threading.Lock] = {}
        self._closed = False
        threading.Thread(target=self._accept, name="peer-link-accept", daemon=True).start()

    # -- sending ------------------------------------------------------------------------------
    def _connection(self, peer: Address) -> tuple[socket.socket, threading.Lock]:
        """The one connection to `peer`, made on first use (one thread makes it; the others wait)."""
        with self._lock:
            entry = self._out.get(peer)
            connecting = self._connecting.setdefault(peer, threading.Lock())
        if entry is not None:
            return entry
        with connecting:
            with self._lock:
                entry = self._out.get(peer)
            if entry is not None:
                return entry
            sock = socket.create_connection(peer, timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = json.dumps({"host": self.address[0], "port": self.address[1]}).encode()
            sock.sendall(_HELLO.pack(len(hello)) + hello)
            entry = (sock, threading.Lock())
            with self._lock:
                self._out[peer] = entry
            return entry

    def send(self, tensor: torch.Tensor, peer: Address, key: Key) -> None:
        """Send now (returns once the bytes are with the kernel); PeerLinkError if the peer is gone."""
        data = _as_bytes(tensor.detach().contiguous().cpu())
        entry = None
        try:
            entry = self._connection(peer)
            sock, lock = entry
            with lock:
                sock.sendall(_HEADER.pack(*key, data.numel()))
                sock.sendall(memoryview(data.numpy()))
        except OSError as exc:
            if entry is not None:
                with self._lock:
                    if self._out.get(peer) is entry:  # only ours: another thread may have made a new one
                        del self._out[peer]
                entry[0].close()
            raise PeerLinkError(f"peer link: sending {key} to {peer[0]}:{peer[1]} failed: {exc}") from None

    def isend(self, tensor: torch.Tensor, peer: Address, key: Key) -> Handle:
        """Send in the calling thread; the handle reports the outcome (a failure raises on wait)."""
        try:
            self.send(tensor, peer, key)
        except PeerLinkError as exc:
            return _FailedHandle(exc)
        return DoneHandle()

    # -- receiving ----------------------------------------------------------------------------
    def irecv(self, tensor: torch.Tensor, peer: Address, key: Key,
              on_done: Optional[Callable[[RecvHandle], None]] = None) -> RecvHandle:
        """Post a receive of `key` from `peer` into `tensor`; `on_done(handle)` runs once it is
        in or has failed (on the link's reader thread, or here if it already arrived)."""
        handle = RecvHandle(self, key, tensor, peer, on_done)
        with self._lock:
            data = self._arrived.pop(key, None)
            gone = peer in self._gone
            if data is None and not gone:
                self._posted[key] = handle
        if data is not None:
            self._fill(handle, data)
        elif gone:
            handle._finish(PeerLinkError(f"peer link: {peer[0]}:{peer[1]} is gone; {key} will not come"))
        return handle

    def _fill(self, handle: RecvHandle, data: bytearray) -> None:
        target = _as_bytes(handle.staging)
        if len(data) != target.numel():
            return handle._finish(PeerLinkError(f"peer link: message {handle.key} has {len(data)} bytes, "
                                                f"the receive expects {target.numel()}"))
        target.copy_(torch.frombuffer(data, dtype=torch.uint8))
        handle._finish()

    def drop(self, first: int) -> None:
        """Forget every message and receive whose key starts with `first` (a cancelled migration);
        messages for it that arrive later are discarded."""
        with self._lock:
            self._dropped.add(first)
            for key in [k for k in self._arrived if k[0] == first]:
                del self._arrived[key]
            dropped = [self._posted.pop(k) for k in [k for k in self._posted if k[0] == first]]
        for handle in dropped:
            handle._finish(PeerLinkError(f"peer link: receive {handle.key} was cancelled"))

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read, args=(conn,), name="peer-link-reader", daemon=True).start()

    @staticmethod
    def _read_exactly(conn: socket.socket, view: memoryview) -> None:
        while len(view):
            n = conn.recv_into(view)
            if n == 0:
                raise EOFError
            view = view[n:]

    def _read(self, conn: socket.socket) -> None:
        peer: Optional[Address] = None
        current: Optional[RecvHandle] = None  # a receive whose bytes are coming in right now
        try:
            head = bytearray(_HELLO.size)
            self._read_exactly(conn, memoryview(head))
            raw = bytearray(_HELLO.unpack(head)[0])
            self._read_exactly(conn, memoryview(raw))
            hello = json.loads(raw)
            peer = (hello["host"], int(hello["port"]))
            with self._lock:
                self._gone.discard(peer)
                self._incoming[peer] = self._incoming.get(peer, 0) + 1
            header = bytearray(_HEADER.size)
            while True:
                self._read_exactly(conn, memoryview(header))
                *key, size = _HEADER.unpack(header)
                key = tuple(key)
                with self._lock:
                    current = self._posted.pop(key, None)
                if current is not None and _as_bytes(current.staging).numel() == size:
                    self._read_exactly(conn, memoryview(_as_bytes(current.staging).numpy()))
                    current, done = None, current
                    done._finish()
                    continue
                data = bytearray(size)
                self._read_exactly(conn, memoryview(data))
                with self._lock:
                    handle = current or self._posted.pop(key, None)  # posted while the bytes came in
                    current = None
                    if handle is None and key[0] not in self._dropped:
                        self._arrived[key] = data
                if handle is not None:
                    self._fill(handle, data)  # a size mismatch fails the receive and says so
        except (OSError, EOFError, ValueError, KeyError):
            pass
        finally:
            conn.close()
            if current is not None:  # the sender went away in the middle of its bytes
                current._finish(PeerLinkError(f"peer link: the connection from {peer[0]}:{peer[1]} closed in the "
                                              f"middle of message {current.key}"))
            if peer is not None and not self._closed:
                self._lost(peer)

    def _lost(self, peer: Address) -> None:
        """A connection from `peer` closed; once none is left, its pending receives fail."""
        with self._lock:
            self._incoming[peer] = self._incoming.get(peer, 1) - 1
            if self._incoming[peer] > 0:
                return
            self._gone.add(peer)
            failed = [self._posted.pop(k) for k, h in list(self._posted.items()) if h.peer == peer]
        for handle in failed:
            handle._finish(PeerLinkError(f"peer link: the connection from {peer[0]}:{peer[1]} closed before "
                                         f"message {handle.key} came"))

    def close(self) -> None:
        self._closed = True
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread; a close alone may not
        except OSError:
            pass
        self._server.close()
        with self._lock:
            entries, self._out = list(self._out.values()), {}
        for sock, _ in entries:
            sock.close()

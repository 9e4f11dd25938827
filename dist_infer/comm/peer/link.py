"""Tagged tensor messages between processes that share no communicator.

Serving instances are separate jobs that come and go: one dies, another is restarted or added
while the rest serve on. A collective communicator cannot take a new member or survive a dead
one, so the KV blocks of a migrating request travel over this instead: every rank listens on
one TCP port, a sender connects to the receiver's advertised address on first use, and each
message carries a key (three integers: migration, stage, sending rank) that the receiver
matches against the receives it has posted.

The port is reachable by anyone on the network, so nothing is trusted before the handshake
(comm/peer/auth.py) proves the other end holds the cluster key and sits on the host it claims.
Even then nothing is allocated from a length on the wire unchecked: a message for a posted
receive must have exactly that receive's size (else that receive fails and the bytes are read
past), a message that comes before its receive is held only within a per-link byte budget
(beyond it the reader waits, bounded, for the receive), and messages of dropped migrations or
of senders that went away are freed. Unauthenticated connections are capped and must finish
the whole handshake in seconds; idle ones are closed; and at the cap on authenticated ones
the least recently used idle one is evicted (its sender dials anew), so the cap bounds the
senders talking at once, not the senders a rank ever hears from. Sending is comm/peer/sender.py;
a posted receive is comm/peer/recv_handle.py.

Nothing here blocks forever: sends and connects have a timeout, a receive's `wait` has one, and
a connection that closes fails the receives still expecting data from that sender's address.
Receives can take a callback (run on the reader thread) so a rank that is not stepping, such
as an idle follower, still reacts the moment its data is in.
"""

from __future__ import annotations

import errno
import secrets
import select
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from loguru import logger

from dist_infer.comm.base import Handle
from dist_infer.comm.peer.auth import Address, HandshakeError, read_exactly, server_handshake, skip_exactly
from dist_infer.comm.peer.recv_handle import RecvHandle
from dist_infer.comm.peer.sender import HEADER, Key, Outbounds, PeerLinkError, as_bytes, fmt
from dist_infer.comm.rate_limited_log import RateLimitedLog

__all__ = ["Address", "Key", "PeerLink", "PeerLinkError"]
_SKIP, _BUFFER = "skip", "buffer"  # what the reader does with a message that has no receive to fill
_DROPPED_KEPT = 4096  # dropped migration ids remembered, so their late messages are read past
MAX_UNMATCHED_BYTES = 256 << 20
_PROCESS_KEY = secrets.token_bytes(32)  # links made without a key: only this process's links share it
_EVICT_GRACE = 1.0  # seconds an evicted connection is still read, for a message its sender sent just then
_GOODBYE = b"\x00"  # the receiver's only write after the handshake: "closing, dial anew"
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


def _readable(sock: socket.socket) -> bool:
    """Bytes (or the end) are waiting on `sock`: a message is starting, or its sender left."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


class _Idle(Exception):
    """A connection sent nothing for the idle timeout: closed, but its sender is not gone."""


@dataclass(eq=False)
class _In:
    """One inbound connection: `peer` once admitted; `busy` while a message is coming in (an
    idle one may be evicted to make room); `leaving` once evicted (it closes when next idle)."""

    sock: socket.socket
    peer: Optional[Address] = None
    busy: bool = False
    leaving: bool = False


class PeerLink:
    """This process's endpoint: `address` is what peers send to; `isend`/`irecv` as in a
    communicator, but peers are addresses, not ranks, and tags are keys.

    `key` is the cluster's shared secret: only links made with the same key talk to each other.
    Without one, the link takes a random key made once per process: the links of this process
    (tests) talk to each other, and a link elsewhere only if given `link.key`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout: float = 30.0,
        key: Optional[bytes | str] = None,
        *,
        idle_timeout: float = 300.0,
        handshake_timeout: float = 5.0,
        max_inbound: int = 64,
        max_handshaking: int = 16,
        max_unmatched_bytes: int = MAX_UNMATCHED_BYTES,
    ):
        self.timeout, self.idle_timeout, self.handshake_timeout = timeout, idle_timeout, handshake_timeout
        self.max_inbound, self.max_handshaking = max_inbound, max_handshaking
        self.max_unmatched_bytes = max_unmatched_bytes
        self.key = _PROCESS_KEY if key is None else key.encode() if isinstance(key, str) else bytes(key)
        if not self.key:
            raise ValueError("peer link: the cluster key is empty")
        host = socket.gethostbyname(host)  # peers check the claimed host against the source IP
        self._server = socket.create_server((host, 0), backlog=64)
        # Set here, not in the accept thread: a link closed before that thread runs has no socket left.
        self._server.settimeout(1.0)  # accept wakes each second to write the counts of refusals held back
        self.address: Address = (host, self._server.getsockname()[1])
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # a reader waiting for a receive to be posted
        self._arrived: dict[Key, tuple[Address, bytearray]] = {}  # messages before their receive
        self._unmatched = 0  # bytes held in _arrived, or being read into it
        self._posted: dict[Key, RecvHandle] = {}
        self._dropped: OrderedDict[int, None] = OrderedDict()  # migrations whose messages are unwanted
        self._gone: set[Address] = set()  # senders whose every connection closed
        self._incoming: dict[Address, int] = {}  # open admitted connections from each sender
        self._inbound: set[socket.socket] = set()  # every open inbound connection
        self._admitted: OrderedDict[_In, None] = OrderedDict()  # not leaving; least recently used first
        self._handshaking = 0
        self._outbound = Outbounds(self.key, self.address, timeout, handshake_timeout, idle_timeout)
        self._closed = False
        self._warn = RateLimitedLog()  # refusals: a line a second per source and reason, with a count
        threading.Thread(target=self._accept, name="peer-link-accept", daemon=True).start()

    # -- sending (comm/peer/sender.py) ----------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: Address, key: Key) -> None:
        """Send now (returns once the bytes are with the kernel); PeerLinkError if the peer is gone."""
        self._outbound.send(tensor, peer, key)

    def isend(self, tensor: torch.Tensor, peer: Address, key: Key) -> Handle:
        """Send in the calling thread; the handle reports the outcome (a failure raises on wait)."""
        return self._outbound.isend(tensor, peer, key)

    # -- receiving ----------------------------------------------------------------------------
    def irecv(
        self, tensor: torch.Tensor, peer: Address, key: Key, on_done: Optional[Callable[[RecvHandle], None]] = None
    ) -> RecvHandle:
        """Post a receive of `key` from `peer` into `tensor`; `on_done(handle)` runs once it is
        in or has failed (on the link's reader thread, or here if it already arrived)."""
        handle = RecvHandle(self, key, tensor, peer, on_done)
        with self._cond:
            entry = self._arrived.pop(key, None)
            if entry is not None:
                self._unmatched -= len(entry[1])
            gone = peer in self._gone
            if entry is None and not gone:
                self._posted[key] = handle
                self._cond.notify_all()  # a reader may be holding this message back for it
        if entry is not None:
            handle.fill(*entry)
        elif gone:
            handle.finish(PeerLinkError(f"peer link: {fmt(peer)} is gone; {key} will not come"))
        return handle

    def drop(self, migration_id: int) -> None:
        """Forget every message and receive of migration `migration_id` (cancelled or over): its
        held bytes are freed, its receives fail, and its messages that come later are read past."""
        with self._cond:
            self._dropped[migration_id] = None
            self._dropped.move_to_end(migration_id)
            while len(self._dropped) > _DROPPED_KEPT:
                self._dropped.popitem(last=False)
            for key in [k for k in self._arrived if k[0] == migration_id]:
                self._unmatched -= len(self._arrived.pop(key)[1])
            dropped = [self._posted.pop(k) for k in [k for k in self._posted if k[0] == migration_id]]
            self._cond.notify_all()
        for handle in dropped:
            handle.finish(PeerLinkError(f"peer link: receive {handle.key} was cancelled"))

    def _accept(self) -> None:
        """Take connections until the link closes; an accept that fails (out of descriptors, a
        connection reset before it was taken) ends only that connection, never the listener."""
        while not self._closed:
            try:
                conn, source = self._server.accept()
            except socket.timeout:
                self._warn.flush()
                continue
            except OSError as exc:
                if self._closed:
                    return
                self._refused("accept failed", "", f"accept failed ({exc}); still listening")
                if exc.errno in _OUT_OF_RESOURCES:
                    time.sleep(0.1)  # it will fail again until a descriptor is freed: do not spin
                continue
            with self._lock:
                full = (
                    self._handshaking >= self.max_handshaking
                    or len(self._inbound) >= self.max_inbound + self.max_handshaking
                )
                if not full:
                    self._inbound.add(conn)
                    self._handshaking += 1
                count, h = len(self._inbound), self._handshaking
            if full:
                conn.close()
                self._refused(
                    "too many open",
                    source[0],
                    f"refused a connection from {source[0]} ({count} open, {h} authenticating)",
                )
                continue
            threading.Thread(target=self._serve, args=(conn, source), name="peer-link-reader", daemon=True).start()

    def _refused(self, reason: str, source: str, message: str) -> None:
        """A refused or failed connection: logged at most once a second per reason and source, with a count."""
        self._warn(
            (reason, source),
            f"peer link {fmt(self.address)}: {message}",
            f"peer link {fmt(self.address)}: "
            f"{{count}} more {'from ' + source + ' ' if source else ''}in the last {{seconds:.1f}} s ({reason})",
        )

    def _admit(self, entry: _In, peer: Address) -> None:
        """Count a sender's authenticated connection in. At `max_inbound`, the least recently used
        idle one is evicted (its sender dials anew when next it sends): connections live for
        minutes, so a rank that over time hears from more senders than that must not refuse the
        newest. Only when every one is busy is this one refused (its sender retries)."""
        with self._lock:
            if self._closed:
                raise EOFError("the link closed")
            victim = None
            if len(self._admitted) >= self.max_inbound:
                victim = next((c for c in self._admitted if not c.busy and not _readable(c.sock)), None)
                if victim is None:
                    raise HandshakeError(f"no room: all {len(self._admitted)} connections are busy")
                del self._admitted[victim]
                victim.leaving = True
                try:
                    victim.sock.send(_GOODBYE, socket.MSG_DONTWAIT)  # its sender's next send dials anew
                except OSError:
                    pass
            entry.peer = peer
            self._admitted[entry] = None
            self._gone.discard(peer)
            self._incoming[peer] = self._incoming.get(peer, 0) + 1
        if victim is not None:
            logger.debug(
                f"peer link {fmt(self.address)}: evicting the idle connection from {fmt(victim.peer)} "
                f"to make room for {fmt(peer)}"
            )
            timer = threading.Timer(_EVICT_GRACE, self._evict_now, args=(victim,))
            timer.daemon = True
            timer.start()

    def _evict_now(self, victim: _In) -> None:
        """The grace for a message already on its way is over: close an evicted connection now,
        unless a message is coming in on it (its reader then closes it once that is in)."""
        with self._lock:  # its reader closes it only after taking it out of _inbound, under this lock
            if self._closed or victim.sock not in self._inbound or victim.busy or _readable(victim.sock):
                return
            try:
                victim.sock.shutdown(socket.SHUT_RDWR)  # wakes its reader
            except OSError:
                pass

    def _serve(self, conn: socket.socket, source: tuple) -> None:
        """One inbound connection: authenticate and admit it, then read its messages until it ends."""
        entry = _In(conn)
        admitted = idle = dropped = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_handshake(
                conn, self.key, self.address, self.handshake_timeout, admit=lambda peer: self._admit(entry, peer)
            )
            admitted = True
        except Exception as exc:  # noqa: BLE001 - whatever a stranger sends ends only its connection
            self._refused(
                "failed handshake",
                source[0],
                f"dropped a connection from {source[0]}:{source[1]}: {type(exc).__name__}: {exc}",
            )
        finally:
            with self._lock:
                self._handshaking -= 1
        try:
            if admitted and entry.peer is not None:  # (admitted: its peer is known)
                conn.settimeout(self.idle_timeout)
                self._read(entry, entry.peer)
        except _Idle:
            idle = True
            logger.debug(
                f"peer link {fmt(self.address)}: closed the connection from {fmt(entry.peer)} after "
                f"{self.idle_timeout:g} s idle"
            )
        except PeerLinkError as exc:
            dropped = True
            self._refused("a bad message", fmt(entry.peer), f"{exc}; closed the connection")
        except (OSError, EOFError):
            pass
        finally:
            with self._lock:
                self._inbound.discard(conn)
                self._admitted.pop(entry, None)
            conn.close()
            if entry.peer is not None:  # admitted (if only just): counted in _incoming
                self._lost(entry.peer, idle or entry.leaving, dropped)

    def _read(self, entry: _In, peer: Address) -> None:
        """Read messages from `peer` until the connection ends, or until it is evicted and idle."""
        conn = entry.sock
        header = bytearray(HEADER.size)
        while not self._closed and not entry.leaving:
            try:
                read_exactly(conn, memoryview(header))
            except socket.timeout:
                raise _Idle from None
            with self._lock:
                entry.busy = True
            *parts, size = HEADER.unpack(header)
            key: Key = tuple(parts)
            if size < 0:
                raise PeerLinkError(f"peer link: {fmt(peer)} sent message {key} with a negative size")
            verdict = self._claim(key, size, peer)
            if verdict == _SKIP:
                skip_exactly(conn, size)
            elif verdict == _BUFFER:
                self._buffer(conn, key, size, peer)
            else:
                self._deliver(conn, verdict, size, peer)
            with self._lock:
                entry.busy = False
                if entry in self._admitted:
                    self._admitted.move_to_end(entry)

    def _claim(self, key: Key, size: int, peer: Address):
        """What to do with a message whose header just came: fill its posted receive, hold it
        (within the byte budget), or read past it (dropped). Over budget, wait for its receive."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if self._closed:
                    raise EOFError("the link closed")
                if key[0] in self._dropped:
                    return _SKIP
                handle = self._posted.pop(key, None)
                if handle is not None:
                    return handle
                if self._unmatched + size <= self.max_unmatched_bytes:
                    self._unmatched += size
                    return _BUFFER
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerLinkError(
                        f"peer link: message {key} of {size} bytes from {fmt(peer)} found no receive within "
                        f"{self.timeout:g} s and no room ({self._unmatched} of {self.max_unmatched_bytes} bytes held)"
                    )
                self._cond.wait(left)

    def _deliver(self, conn: socket.socket, handle: RecvHandle, size: int, peer: Address) -> None:
        error = handle.mismatch(peer, size)
        if error is not None:
            handle.finish(error)  # that receive fails; the stream stays in step
            return skip_exactly(conn, size)
        try:
            read_exactly(conn, as_bytes(handle.staging).numpy().data)  # (a memoryview of its buffer)
        except BaseException as exc:
            handle.finish(
                PeerLinkError(
                    f"peer link: the connection from {fmt(peer)} closed in the middle of "
                    f"message {handle.key}: {type(exc).__name__}"
                )
            )
            raise
        handle.finish()

    def _buffer(self, conn: socket.socket, key: Key, size: int, peer: Address) -> None:
        """Hold a message that came before its receive (its bytes are already counted)."""
        data = bytearray(size)
        try:
            read_exactly(conn, memoryview(data))
        except BaseException:
            with self._lock:
                self._unmatched -= size
            raise
        with self._lock:
            handle = self._posted.pop(key, None)  # posted while the bytes came in
            if handle is None and key[0] not in self._dropped:
                old = self._arrived.pop(key, None)
                if old is not None:
                    self._unmatched -= len(old[1])
                self._arrived[key] = (peer, data)
                return
            self._unmatched -= size
        if handle is not None:
            handle.fill(peer, data)  # a size mismatch fails the receive and says so

    def _lost(self, peer: Address, idle: bool = False, dropped: bool = False) -> None:
        """A connection from `peer` closed; once none is left (and not merely for idleness), its
        pending receives fail. If it closed (not we, for a bad message), the sender is gone: the
        messages it sent that nobody took are freed, and later receives from it fail at once."""
        with self._lock:
            self._incoming[peer] = self._incoming.get(peer, 1) - 1
            if self._incoming[peer] > 0 or self._closed:
                return
            del self._incoming[peer]
            if idle:
                return
            failed = [self._posted.pop(k) for k, h in list(self._posted.items()) if h.peer == peer]
            if not dropped:
                self._gone.add(peer)
                for key in [k for k, (sender, _) in self._arrived.items() if sender == peer]:
                    self._unmatched -= len(self._arrived.pop(key)[1])
        for handle in failed:
            handle.finish(
                PeerLinkError(f"peer link: the connection from {fmt(peer)} closed before message {handle.key} came")
            )

    def close(self) -> None:
        with self._cond:
            self._closed = True
            inbound = list(self._inbound)
            self._arrived.clear()
            self._unmatched = 0
            self._cond.notify_all()
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread; a close alone may not
        except OSError:
            pass
        self._server.close()
        self._outbound.close()
        for sock in inbound:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes its reader
            except OSError:
                pass
            sock.close()

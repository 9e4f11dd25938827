"""The peer link's handshake: both ends prove they hold the cluster key before any data moves.

Anyone who can reach a rank's link port could otherwise inject KV blocks into a live migration
(keys are guessable) or make the rank allocate from a forged length. So each connection starts
with a mutual challenge: the dialling side (the sender) sends a random nonce and the listening
address it claims; the listening side answers with its own nonce and an HMAC over both nonces
and its address; the sender checks that, then answers with an HMAC over both nonces and its
claimed address; the listener checks that and that the connection really comes from the
claimed host. Every read here is bounded in size, and the whole handshake by one deadline (not
each read: a peer dripping a byte every few seconds would otherwise hold its slot for ever);
nothing is allocated from a length the peer chose beyond a 255-byte host name.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
import struct
import time
from typing import Callable, Optional

Address = tuple[str, int]
MAGIC = b"DIPLINK1"
NONCE_BYTES = 32
_HELLO = struct.Struct("!8s32sHB")  # magic, client nonce, claimed port, claimed host length
_SERVER = struct.Struct("!32s32s")  # server nonce, server MAC
_ACCEPTED, _REFUSED = b"\x01", b"\x00"


class HandshakeError(ConnectionError):
    """The other end failed the challenge, spoke another protocol, or claimed an address it is not at."""


def _mac(key: bytes, role: bytes, own: bytes, other: bytes, address: Address) -> bytes:
    claimed = f"{address[0]}:{address[1]}".encode()
    return hmac.new(key, role + b"|" + own + other + b"|" + claimed, hashlib.sha256).digest()


def read_exactly(conn: socket.socket, view: memoryview) -> None:
    """Fill `view` from `conn` (the socket's own timeout bounds each wait); EOFError if it closes."""
    while len(view):
        n = conn.recv_into(view)
        if n == 0:
            raise EOFError("the connection closed")
        view = view[n:]


def skip_exactly(conn: socket.socket, size: int) -> None:
    """Read past `size` bytes (a message nobody takes) through a small scratch buffer."""
    scratch = memoryview(bytearray(min(size, 1 << 20)))
    while size > 0:
        n = min(size, len(scratch))
        read_exactly(conn, scratch[:n])
        size -= n


def _left(conn: socket.socket, deadline: float) -> None:
    """Bound the next socket call by what is left of the handshake's time."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("the handshake did not finish in time")
    conn.settimeout(left)


def _read(conn: socket.socket, size: int, deadline: float) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    while len(view):
        _left(conn, deadline)
        n = conn.recv_into(view)
        if n == 0:
            raise EOFError("the connection closed")
        view = view[n:]
    return bytes(buf)


def _send(conn: socket.socket, data: bytes, deadline: float) -> None:
    _left(conn, deadline)
    conn.sendall(data)  # the timeout bounds the whole sendall


def client_handshake(conn: socket.socket, key: bytes, own: Address, dialled: Address, timeout: float) -> None:
    """The sender's half: prove the key to the listener at `dialled`, and check that it holds it too."""
    deadline = time.monotonic() + timeout
    host = own[0].encode()
    nonce = secrets.token_bytes(NONCE_BYTES)
    _send(conn, _HELLO.pack(MAGIC, nonce, own[1], len(host)) + host, deadline)
    theirs, their_mac = _SERVER.unpack(_read(conn, _SERVER.size, deadline))
    if not hmac.compare_digest(their_mac, _mac(key, b"server", theirs, nonce, dialled)):
        raise HandshakeError(f"{dialled[0]}:{dialled[1]} does not hold the cluster key")
    _send(conn, _mac(key, b"client", nonce, theirs, own), deadline)
    if _read(conn, 1, deadline) != _ACCEPTED:
        raise HandshakeError(f"{dialled[0]}:{dialled[1]} refused the connection")


def _same_host(claimed: str, source: str) -> bool:
    try:
        a, b = ipaddress.ip_address(claimed), ipaddress.ip_address(source)
    except ValueError:
        return False
    if isinstance(b, ipaddress.IPv6Address) and b.ipv4_mapped is not None:
        b = b.ipv4_mapped
    return a == b


def _refuse(conn: socket.socket, why: str) -> None:
    """Tell the sender it was refused (so it does not retry), then fail."""
    try:
        conn.sendall(_REFUSED)
    except OSError:
        pass
    raise HandshakeError(why)


def server_handshake(
    conn: socket.socket, key: bytes, own: Address, timeout: float, admit: Optional[Callable[[Address], None]] = None
) -> Address:
    """The listener's half: -> the sender's proven listening address, or HandshakeError.
    `admit(address)` runs before the sender is told it is in, so a listener with no room can
    refuse by raising: the connection then closes unanswered, and the sender tries again."""
    deadline = time.monotonic() + timeout
    magic, nonce, port, length = _HELLO.unpack(_read(conn, _HELLO.size, deadline))
    if magic != MAGIC:
        raise HandshakeError("not a peer-link hello")
    try:
        claimed = (_read(conn, length, deadline).decode("ascii"), port)
    except UnicodeDecodeError:
        raise HandshakeError("a hello with a malformed host") from None
    mine = secrets.token_bytes(NONCE_BYTES)
    _send(conn, _SERVER.pack(mine, _mac(key, b"server", mine, nonce, own)), deadline)
    answer = _read(conn, hashlib.sha256().digest_size, deadline)
    source = conn.getpeername()[0]
    if not hmac.compare_digest(answer, _mac(key, b"client", nonce, mine, claimed)):
        _refuse(conn, f"a peer at {source} claiming {claimed[0]}:{claimed[1]} does not hold the cluster key")
    if not _same_host(claimed[0], source):
        _refuse(conn, f"a peer at {source} claims to listen on {claimed[0]}:{claimed[1]}")
    if admit is not None:
        admit(claimed)
    _send(conn, _ACCEPTED, deadline)
    return claimed

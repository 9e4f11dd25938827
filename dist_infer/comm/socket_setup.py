"""Connecting a group's TCP links (comm/socket_links.py): one socket per pair of its ranks.

Collective over the group's inner communicator. Each rank but the last listens on its address on
the job's network (never the wildcard), the group's addresses and a random key from its first rank
go round, every rank dials the ranks before it and proves the key, and each listener takes only
its expected peers and is closed as soon as they are in. A connection gets seconds to prove the
key, from its start; anything else that connects is closed. The whole set-up has a deadline, and
its outcome is agreed on: if any rank could not listen, dial or accept, every rank raises
LinksUnavailable together (the caller then keeps the backend's collectives), never some ranks on
links and others waiting on them.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import struct
import time

import torch

from dist_infer.comm.base import CommError, Communicator
from dist_infer.topology.network import interface_addresses, local_address_towards

HELLO = b"dist-infer/links1"  # + the group's key + the dialer's group rank
KEY_BYTES = 32
HELLO_BYTES = len(HELLO) + KEY_BYTES + 4
HELLO_S = 2.0  # how long a new connection has, from its start, to prove the key
SETUP_S = 30.0  # the whole set-up, at most (or the group's timeout, if shorter)
_NO_LISTENER = "-"  # the address a rank advertises when it could not listen


class LinksUnavailable(CommError):
    """The group could not connect its links; every rank of it raised this together."""


def job_address() -> str:
    """This rank's address on the job's network: the interface gloo was told to use
    (GLOO_SOCKET_IFNAME, set for multi-host jobs and by --iface), else the address that routes to
    MASTER_ADDR, else loopback (a one-host job)."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if iface and iface in (found := interface_addresses()):
        return found[iface]
    try:
        return local_address_towards(socket.gethostbyname(os.environ.get("MASTER_ADDR", "127.0.0.1")))
    except OSError:
        return "127.0.0.1"


def connect_group(inner: Communicator, address: str, across_hosts: bool, what: str) -> dict[int, socket.socket]:
    """Connected, authenticated sockets to every other rank of `inner`'s group, by group rank."""
    deadline = time.monotonic() + min(inner.timeout, SETUP_S)
    listener, reason, port = None, "", 0
    if across_hosts and _is_loopback(address):
        reason = f"this rank has no address on the job's network (found {address})"
    elif inner.rank < inner.size - 1:
        try:
            listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((address, 0))
            listener.listen(inner.size)
            port = listener.getsockname()[1]
        except OSError as exc:
            reason = f"cannot listen on {address}: {exc}"
    socks: dict[int, socket.socket] = {}
    try:
        where = _exchange(inner, _NO_LISTENER if reason else address, port)
        key = _group_key(inner)
        absent = [r for r, (host, _) in enumerate(where) if host == _NO_LISTENER]
        if absent:
            reason = reason or f"group ranks {absent} could not listen"
        else:
            try:
                for peer in range(inner.rank):
                    socks[peer] = _dial(inner.rank, peer, where[peer], key, deadline)
                if listener is not None:
                    _accept(listener, inner.rank, inner.size, key, deadline, socks)
            except OSError as exc:
                reason = str(exc)
    finally:
        if listener is not None:
            listener.close()
    agreed = torch.tensor([0 if reason else 1], dtype=torch.int64)
    inner.all_reduce(agreed, op="min")
    if int(agreed.item()) == 1:
        return socks
    for sock in socks.values():
        sock.close()
    raise LinksUnavailable(f"{what}: {reason or 'another rank of the group could not connect its links'}")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _exchange(inner: Communicator, address: str, port: int) -> list[tuple[str, int]]:
    """Every group rank's (address, port)."""
    mine = torch.zeros(64, dtype=torch.uint8)
    text = f"{address} {port}".encode()[:64]
    mine[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    every = torch.empty(inner.size * 64, dtype=torch.uint8)
    inner.all_gather(every, mine)
    out = []
    for r in range(inner.size):
        host, port_text = bytes(every[r * 64 : (r + 1) * 64].tolist()).rstrip(b"\0").decode().split(" ")
        out.append((host, int(port_text)))
    return out


def _group_key(inner: Communicator) -> bytes:
    key = torch.tensor(list(secrets.token_bytes(KEY_BYTES)), dtype=torch.uint8)
    inner.broadcast(key, src=0)
    return bytes(key.tolist())


def _dial(me: int, peer: int, where: tuple[str, int], key: bytes, deadline: float) -> socket.socket:
    sock = None
    try:
        sock = socket.create_connection(where, timeout=max(0.1, deadline - time.monotonic()))
        sock.sendall(HELLO + key + struct.pack("<i", me))
        return sock
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise OSError(f"cannot reach group rank {peer} at {where[0]}:{where[1]}: {exc}") from None


def _accept(
    listener: socket.socket, me: int, size: int, key: bytes, deadline: float, socks: dict[int, socket.socket]
) -> None:
    """Every later rank's connection into `socks`; anything that does not prove the key is closed."""
    expected = set(range(me + 1, size))
    while expected:
        left = deadline - time.monotonic()
        if left <= 0:
            raise OSError(f"group ranks {sorted(expected)} did not connect in time")
        listener.settimeout(left)
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            continue
        peer = hello(sock, key, min(time.monotonic() + HELLO_S, deadline))
        if peer in expected:
            expected.discard(peer)
            socks[peer] = sock
        else:
            sock.close()


def hello(sock: socket.socket, key: bytes, deadline: float) -> int:
    """The group rank a new connection proves it is by `deadline`, or -1 (wrong key, too slow, garbage)."""
    got = b""
    try:
        while len(got) < HELLO_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                return -1
            sock.settimeout(left)
            chunk = sock.recv(HELLO_BYTES - len(got))
            if not chunk:
                return -1
            got += chunk
    except OSError:
        return -1
    if got[: len(HELLO)] != HELLO or not hmac.compare_digest(got[len(HELLO) : len(HELLO) + KEY_BYTES], key):
        return -1
    return struct.unpack("<i", got[-4:])[0]

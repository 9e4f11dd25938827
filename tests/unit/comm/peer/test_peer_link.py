"""The peer link against hostile peers: whatever reaches a rank's link port, an honest
transfer still delivers exact bytes, memory and threads stay bounded, and only the holders of
the cluster key get a message in."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
import time

import pytest
import torch
from loguru import logger

from dist_infer.comm.base import CommTimeoutError
from dist_infer.comm.peer.auth import MAGIC, HandshakeError, client_handshake
from dist_infer.comm.peer.link import PeerLink, PeerLinkError
from tests.support.polling import wait_until

KEY = secrets.token_hex(16).encode()
RSS_BOUND = 200 << 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def links():
    made = [PeerLink(timeout=5.0, key=KEY, handshake_timeout=1.0) for _ in range(3)]
    yield made
    for link in made:
        link.close()


def _transfer(src: PeerLink, dst: PeerLink, numel: int = 4096) -> None:
    """An honest message from src to dst arrives with exactly its bytes."""
    x = torch.randn(numel)
    key = (secrets.randbits(62), 1, 3)  # migration ids are random 62-bit ints
    got = torch.empty_like(x)
    handle = dst.irecv(got, src.address, key)
    src.send(x, dst.address, key)
    handle.wait(10)
    assert torch.equal(got, x)


def _raw(link: PeerLink, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(link.address, timeout=5, source_address=(source, 0))
    return sock


def _closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def _forged_handshake(link: PeerLink, key: bytes, claimed: tuple[str, int], source: str = "127.0.0.1") -> bytes:
    """A client that ignores the server's proof and answers with `key`: -> what the server says."""
    sock = _raw(link, source)
    try:
        nonce = secrets.token_bytes(32)
        host = claimed[0].encode()
        sock.sendall(struct.pack("!8s32sHB", MAGIC, nonce, claimed[1], len(host)) + host)
        reply = b""
        while len(reply) < 64:
            reply += sock.recv(64 - len(reply))
        theirs = reply[:32]
        text = f"{claimed[0]}:{claimed[1]}".encode()
        sock.sendall(hmac.new(key, b"client|" + nonce + theirs + b"|" + text, hashlib.sha256).digest())
        return sock.recv(1)
    finally:
        sock.close()


def test_honest_links_match_messages_in_any_order(links):
    a, b, _ = links
    _transfer(a, b)
    x = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    a.send(x, b.address, (7, 0, 0))  # before its receive: held within the budget
    got = torch.empty_like(x)
    b.irecv(got, a.address, (7, 0, 0)).wait(5)
    assert torch.equal(got, x)
    with pytest.raises(CommTimeoutError):
        b.irecv(torch.empty(3), a.address, (8, 0, 0)).wait(0.2)


def test_garbage_bytes_are_refused(links):
    a, b, _ = links
    before = _rss()
    for _ in range(5):
        sock = _raw(b)
        sock.sendall(os.urandom(4096))
        assert _closed_by_peer(sock)
        sock.close()
    _transfer(a, b)
    assert _rss() - before < RSS_BOUND


def test_silent_and_reset_connections(links):
    a, b, _ = links
    silent = _raw(b)
    reset = _raw(b)
    reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    reset.close()  # an RST right after connect
    _transfer(a, b)
    assert _closed_by_peer(silent, timeout=5.0)  # the handshake timeout ends it
    silent.close()
    _transfer(a, b)


def test_huge_length_prefix_allocates_nothing(links):
    a, b, _ = links
    before = _rss()
    socks = []
    for _ in range(3):
        sock = _raw(b)
        sock.sendall(struct.pack("!I", 1 << 30))  # the old hello's length prefix
        socks.append(sock)
    sock = _raw(b)
    sock.sendall(struct.pack("!qqqq", 1, 0, 0, 1 << 30))  # a message header, no handshake
    socks.append(sock)
    _transfer(a, b)
    assert _rss() - before < RSS_BOUND
    for sock in socks:
        assert _closed_by_peer(sock)
        sock.close()


def test_wrong_key_is_refused_both_ways(links):
    a, b, _ = links
    intruder = PeerLink(timeout=2.0, key=b"not the cluster key")
    try:
        with pytest.raises(PeerLinkError, match="does not hold the cluster key"):
            intruder.send(torch.ones(3), b.address, (1, 0, 0))  # the sender sees the listener fail
        assert _forged_handshake(b, b"not the cluster key", intruder.address) == b"\x00"  # and vice versa
        got = torch.empty(3)
        handle = b.irecv(got, intruder.address, (1, 0, 0))
        with pytest.raises(CommTimeoutError):
            handle.wait(0.3)
    finally:
        intruder.close()
    _transfer(a, b)


def test_a_hello_claiming_another_host_is_refused(links):
    a, b, c = links
    _transfer(a, b)  # a's own connection is up (a closed forged one must not make b think a is gone)
    # the right key, but the connection comes from 127.0.0.1 and claims a rank on "another host"
    assert _forged_handshake(b, KEY, ("127.0.0.2", c.address[1])) == b"\x00"
    # and a connection from 127.0.0.2 claiming to be rank a on 127.0.0.1
    assert _forged_handshake(b, KEY, a.address, source="127.0.0.2") == b"\x00"
    # the same hello from the claimed host is accepted
    assert _forged_handshake(b, KEY, a.address) == b"\x01"
    sock = _raw(b)
    with pytest.raises(HandshakeError):  # a listener that is not at the address dialled fails the sender's check
        client_handshake(sock, KEY, a.address, ("127.0.0.1", b.address[1] + 1), 2.0)
    sock.close()
    _transfer(a, b)
    _transfer(c, b)


def test_many_idle_connections_are_capped(links):
    a, b, c = links
    _transfer(a, b)
    threads, before = threading.active_count(), _rss()
    socks = []
    for _ in range(300):
        try:
            socks.append(_raw(b))
        except OSError:
            pass  # the backlog is full: refused is fine
    assert threading.active_count() - threads < 100
    _transfer(a, b)  # the established connection is untouched
    _transfer(c, b)  # a new honest peer gets in once the silent ones time out
    for sock in socks:
        sock.close()
    wait_until(lambda: len(b._inbound) <= 2, 10.0, "len(b._inbound) <= 2")
    assert threading.active_count() - threads < 100
    assert _rss() - before < RSS_BOUND


def test_size_mismatch_fails_only_that_receive(links):
    a, b, _ = links
    posted = b.irecv(torch.empty(3), a.address, (5, 0, 0))  # posted first: 12 bytes
    a.send(torch.ones(4), b.address, (5, 0, 0))
    with pytest.raises(PeerLinkError, match="16 bytes, the receive expects 12"):
        posted.wait(5)
    a.send(torch.ones(4), b.address, (5, 1, 0))  # held first, then the receive is posted
    with pytest.raises(PeerLinkError, match="16 bytes, the receive expects 12"):
        b.irecv(torch.empty(3), a.address, (5, 1, 0)).wait(5)
    _transfer(a, b)  # the same connection still carries the next message intact


def test_dropped_migration_is_freed_and_late_messages_discarded(links):
    a, b, _ = links
    mid = secrets.randbits(62)
    for stage in range(3):
        a.send(torch.ones(1024), b.address, (mid, stage, 0))
    _transfer(a, b)  # same connection, so the three are in by now
    assert b._unmatched == 3 * 4096
    pending = b.irecv(torch.empty(1024), a.address, (mid, 9, 0))
    b.drop(mid)
    with pytest.raises(PeerLinkError, match="cancelled"):
        pending.wait(1)
    assert b._unmatched == 0 and not b._arrived
    a.send(torch.ones(1024), b.address, (mid, 4, 0))  # late: read past
    _transfer(a, b)
    assert b._unmatched == 0 and not b._arrived


def test_a_closed_senders_messages_are_freed(links):
    a, b, _ = links
    a.send(torch.ones(1024), b.address, (11, 0, 0))
    wait_until(lambda: b._unmatched == 4096, 10.0, "b._unmatched == 4096")
    a.close()
    wait_until(lambda: b._unmatched == 0 and not b._arrived, 10.0, "b._unmatched == 0 and not b._arrived")
    with pytest.raises(PeerLinkError, match="is gone"):
        b.irecv(torch.empty(1024), a.address, (11, 0, 0)).wait(1)


def test_unmatched_bytes_are_capped():
    a = PeerLink(timeout=5.0, key=KEY)
    b = PeerLink(timeout=1.0, key=KEY, max_unmatched_bytes=1 << 20)
    try:
        before = _rss()
        big = torch.randn(1 << 20)  # 4 MiB: over b's budget
        got = torch.empty_like(big)
        sender = threading.Thread(target=a.send, args=(big, b.address, (21, 0, 0)), daemon=True)
        sender.start()  # a's send blocks: b reads nothing of it until its receive is posted
        time.sleep(0.2)
        b.irecv(got, a.address, (21, 0, 0)).wait(5)  # the reader waited for the receive
        sender.join(5)
        assert torch.equal(got, big) and b._unmatched == 0
        try:  # nobody posts this one: b drops the connection (the send fails, or the kernel took it all)
            a.send(big, b.address, (22, 0, 0))
        except PeerLinkError:
            pass
        wait_until(lambda: not b._incoming, 5, "not b._incoming")
        assert b._unmatched == 0 and _rss() - before < RSS_BOUND
        _transfer(a, b)  # a notices the closed connection and makes a new one
    finally:
        a.close()
        b.close()


def test_idle_connections_close_without_failing_receives():
    a = PeerLink(timeout=5.0, key=KEY)
    b = PeerLink(timeout=5.0, key=KEY, idle_timeout=0.5)
    try:
        _transfer(a, b)
        pending = b.irecv(torch.empty(4), a.address, (31, 0, 0))
        wait_until(lambda: not b._inbound, 5, "not b._inbound")  # closed for idleness
        assert not pending.is_completed()  # but the sender is not gone
        x = torch.randn(4)
        a.send(x, b.address, (31, 0, 0))  # a reconnects rather than write into the closed socket
        pending.wait(5)
        assert torch.equal(pending.tensor, x)
    finally:
        a.close()
        b.close()


def _drip(link: PeerLink, within: float = 10.0) -> bool:
    """A hello sent one byte every 0.2 s: -> whether the link closed the connection within `within` s
    (the whole handshake, 75 bytes, would take 15 s at that pace)."""
    sock = _raw(link)
    sock.settimeout(None)  # blocking, so that MSG_DONTWAIT only peeks (with a timeout, recv waits for data)
    deadline = time.monotonic() + within
    try:
        for byte in MAGIC + bytes(67):
            try:
                sock.send(bytes([byte]))
                if sock.recv(1, socket.MSG_DONTWAIT) == b"":
                    return True
            except BlockingIOError:
                pass  # nothing to read: still open
            except OSError:
                return True  # reset
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return False
    finally:
        sock.close()


def test_slow_drip_handshakes_are_cut_off_as_a_whole():
    a = PeerLink(timeout=5.0, key=KEY)
    b = PeerLink(timeout=5.0, key=KEY, handshake_timeout=0.5, max_handshaking=2)
    try:
        closed: list[bool] = []
        drippers = [threading.Thread(target=lambda: closed.append(_drip(b)), daemon=True) for _ in range(2)]
        for thread in drippers:
            thread.start()
        with contextlib.suppress(AssertionError):  # both slots held (briefly: not always seen)
            wait_until(lambda: b._handshaking == 2, 2, "both handshake slots held")
        _transfer(a, b)  # a's dial is refused until the drippers are cut off, then gets in
        for thread in drippers:
            thread.join(15)
        assert closed == [True, True]
        wait_until(lambda: b._handshaking == 0, 10.0, "b._handshaking == 0")
    finally:
        a.close()
        b.close()


def test_a_failed_accept_does_not_stop_the_listener(links, monkeypatch):
    a, b, c = links
    real, failed = socket.socket.accept, []

    def flaky(sock):
        if sock is b._server and not failed:
            failed.append(True)
            raise OSError(errno.EMFILE, "Too many open files")
        return real(sock)

    monkeypatch.setattr(socket.socket, "accept", flaky)
    _transfer(c, b)  # the accept already waiting takes this one; the next accept fails once
    _transfer(a, b)  # a new connection after the failure still gets in
    assert failed


def _busy_connection(link: PeerLink, claimed: tuple[str, int]) -> socket.socket:
    """An authenticated connection in the middle of a message: its header and 10 of 1000 bytes."""
    sock = _raw(link)
    client_handshake(sock, KEY, claimed, link.address, 2.0)
    sock.sendall(struct.pack("!qqqq", secrets.randbits(62), 0, 0, 1000) + bytes(10))
    return sock


def test_a_full_link_evicts_its_least_recently_used_idle_connection():
    b = PeerLink(timeout=5.0, key=KEY, max_inbound=2)
    senders = [PeerLink(timeout=5.0, key=KEY) for _ in range(4)]
    try:
        _transfer(senders[0], b)
        pending = b.irecv(torch.empty(4), senders[0].address, (41, 0, 0))
        for sender in senders[1:]:
            _transfer(sender, b)  # the third and fourth sender each evict the least recently used
        assert len(b._admitted) == 2
        # the evicted ones closed after their grace
        wait_until(lambda: len(b._inbound) == 2, 10.0, "len(b._inbound) == 2")
        assert not pending.is_completed()  # an evicted sender is not gone
        x = torch.randn(4)
        senders[0].send(x, b.address, (41, 0, 0))  # it dials anew, evicting another
        pending.wait(5)
        assert torch.equal(pending.tensor, x)
        for sender in senders:
            _transfer(sender, b)
    finally:
        for link in [b, *senders]:
            link.close()


def test_a_full_link_refuses_only_while_every_connection_is_busy():
    b = PeerLink(timeout=5.0, key=KEY, max_inbound=2)
    a = PeerLink(timeout=1.0, key=KEY)
    busy = [_busy_connection(b, ("127.0.0.1", port)) for port in (1, 2)]
    try:
        wait_until(
            lambda: len(b._admitted) == 2 and all(c.busy for c in b._admitted),
            10.0,
            "two admitted connections, both busy",
        )
        with pytest.raises(PeerLinkError):
            a.send(torch.ones(4), b.address, (1, 0, 0))  # refused until a's timeout
        busy[0].sendall(bytes(990))  # its message is in: that connection is idle now
        wait_until(lambda: sum(c.busy for c in b._admitted) == 1, 10.0, "sum(c.busy for c in b._admitted) == 1")
        _transfer(a, b)  # and is evicted for a
        assert _closed_by_peer(busy[0])
    finally:
        for sock in busy:
            sock.close()
        a.close()
        b.close()


@pytest.fixture
def warnings_logged():
    lines: list[str] = []
    logger.enable("dist_infer")  # the library is quiet unless enabled
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    yield lines
    logger.remove(sink)
    logger.disable("dist_infer")


def test_a_flood_of_bad_connections_writes_a_few_lines_with_counts(links, warnings_logged):
    """200 connections that fail the handshake: the first is logged in full, the rest in one
    line a second with their count (each was logged, 773k lines in 100 s at the hub, before)."""
    a, b, _ = links
    for _ in range(200):
        sock = _raw(b)
        sock.sendall(b"not a peer-link hello" + bytes(64))
        assert _closed_by_peer(sock)
        sock.close()
    _transfer(a, b)

    def dropped() -> list[str]:
        return [line for line in warnings_logged if "failed handshake" in line or "dropped a connection" in line]

    def told() -> int:  # the first in full, the rest counted in summaries (the accept loop flushes each second)
        return len(dropped()) and 1 + sum(
            int(line.split(": ")[1].split(" more")[0]) for line in dropped() if " more from " in line
        )

    wait_until(lambda: told() == 200, 10.0, lambda: f"200 refusals told in {dropped()}")
    assert len(dropped()) <= 6, dropped()

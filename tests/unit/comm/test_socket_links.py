"""The group's own TCP links (comm/socket_links.py) between threads of this process, on 127.0.0.1:
exact sums, the handshake refusing strangers, a peer's end and a missing peer failing the op.
(Real processes, 3 ranks and two hosts: tests/integration/test_shm_and_overlap.py, test_two_hosts.py.)"""

from __future__ import annotations

import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

from dist_infer.comm import socket_setup
from dist_infer.comm.base import CommError, CommTimeoutError
from dist_infer.comm.socket_links import SocketLinksCommunicator
from dist_infer.comm.socket_setup import HELLO, HELLO_BYTES, LinksUnavailable, hello, job_address


class _ThreadGroup:
    """What set-up asks of the inner communicator (all_gather, broadcast), between threads."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=10), [None] * size


class _ThreadInner:
    backend = "threads"

    def __init__(self, group: _ThreadGroup, rank: int, timeout: float = 10.0):
        self.group, self.rank, self.ranks, self.name, self.timeout = group, rank, tuple(range(group.size)), "t", timeout
        self.size = group.size

    def all_gather(self, output, input, async_op=False):
        self.group.slots[self.rank] = input.clone()
        self.group.barrier.wait()
        torch.cat(self.group.slots, out=output)
        self.group.barrier.wait()

    def all_reduce(self, tensor, op="sum", async_op=False):
        self.group.slots[self.rank] = tensor.clone()
        self.group.barrier.wait()
        stacked = torch.stack(self.group.slots)
        tensor.copy_({"sum": stacked.sum(0), "min": stacked.min(0).values}[op])
        self.group.barrier.wait()

    def broadcast(self, tensor, src=0, async_op=False):
        if self.rank == src:
            self.group.slots[0] = tensor.clone()
        self.group.barrier.wait()
        tensor.copy_(self.group.slots[0])
        self.group.barrier.wait()

    def destroy(self):
        pass


@contextmanager
def _links(size: int, timeout: float = 10.0) -> Iterator[list[SocketLinksCommunicator]]:
    """A connected group of `size` threads' communicators, closed after the block."""
    group = _ThreadGroup(size)
    with ThreadPoolExecutor(size) as pool:
        comms = list(
            pool.map(lambda r: SocketLinksCommunicator(_ThreadInner(group, r, timeout), "127.0.0.1"), range(size))
        )
    try:
        yield comms
    finally:
        for c in comms:
            c.close()


def _each(comms, body):
    with ThreadPoolExecutor(len(comms)) as pool:
        return list(pool.map(body, comms))


def test_sums_are_exact_and_the_same_on_every_rank():
    with _links(3) as comms:
        parts = [torch.randn(3, 100, generator=torch.Generator().manual_seed(r)) for r in range(3)]

        def body(c):
            mine = [parts[c.rank][i].clone() for i in range(3)]
            handles = [c.all_reduce(t, async_op=True) for t in mine]
            for h in reversed(handles):  # waited in the other order than posted
                h.wait()
            return mine

        results = _each(comms, body)
        want = [parts[0][i] + parts[1][i] + parts[2][i] for i in range(3)]
        for got in results:
            assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_stranger_during_set_up_is_refused_and_the_group_still_forms(monkeypatch):
    """A connection that cannot prove the group's key is closed; the expected peer still gets in."""
    strangers: list[socket.socket] = []
    exchange = socket_setup._exchange

    def exchange_then_intrude(inner, address, port):
        where = exchange(inner, address, port)
        if inner.rank == 1:  # before rank 1 dials rank 0, someone else does
            assert where[0][0] == "127.0.0.1"  # the listener is on the given address, not the wildcard
            s = socket.create_connection(where[0], timeout=5)
            s.sendall(HELLO + b"\0" * 32 + struct.pack("<i", 1))
            strangers.append(s)
        return where

    monkeypatch.setattr(socket_setup, "_exchange", exchange_then_intrude)
    try:
        with _links(2) as comms:
            strangers[0].settimeout(5)
            assert strangers[0].recv(1) == b""  # closed by rank 0
            got = _each(comms, lambda c: (lambda t: (c.all_reduce(t), t)[1])(torch.full((4,), float(c.rank + 1))))
            assert all(torch.equal(t, torch.full((4,), 3.0)) for t in got)
    finally:
        for s in strangers:
            s.close()


def test_the_handshake():
    key = b"k" * 32
    cases = {
        HELLO + key + struct.pack("<i", 2): 2,
        HELLO + b"x" * 32 + struct.pack("<i", 2): -1,
        b"GET / HTTP/1.1\r\n" + b"\0" * 40: -1,
        HELLO[:5]: -1,
    }
    for sent, want in cases.items():
        a, b = socket.socketpair()
        try:
            a.sendall(sent)
            if len(sent) < HELLO_BYTES:
                a.shutdown(socket.SHUT_WR)
            assert hello(b, key, time.monotonic() + 2.0) == want, sent
        finally:
            a.close()
            b.close()
    a, b = socket.socketpair()  # says a little, then nothing: given up on at the deadline, not per byte
    try:
        a.sendall(HELLO[:3])
        started = time.monotonic()
        assert hello(b, key, started + 0.2) == -1
        assert time.monotonic() - started < 2.0
    finally:
        a.close()
        b.close()


def test_a_group_across_hosts_without_an_address_on_the_network_is_refused_on_every_rank():
    """Loopback is no use to a peer on another host: every rank raises together (build_groups then
    keeps the backend's collectives), none is left waiting on a link."""
    group = _ThreadGroup(2)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(SocketLinksCommunicator, _ThreadInner(group, r), "127.0.0.1", True) for r in range(2)]
        for f in futures:
            with pytest.raises(LinksUnavailable, match="no address on the job's network"):
                f.result(timeout=20)


def test_a_part_is_taken_when_posted():
    """The caller may overwrite its tensor after an async post, or reduce-scatter into its own
    chunk of the input: the sum uses what was posted."""
    with _links(3) as comms:

        def body(c):
            full = torch.arange(6, dtype=torch.float32) + 10 * c.rank
            handle = c.reduce_scatter(full[2 * c.rank : 2 * c.rank + 2], full, async_op=True)
            other = torch.full((4,), float(c.rank))
            h2 = c.all_reduce(other, async_op=True)
            other.fill_(100.0)  # after the post: not what the others get
            handle.wait()
            h2.wait()
            return full[2 * c.rank : 2 * c.rank + 2].clone(), other

        want = sum(torch.arange(6, dtype=torch.float32) + 10 * r for r in range(3))
        for rank, (chunk, other) in enumerate(_each(comms, body)):
            assert torch.equal(chunk, want[2 * rank : 2 * rank + 2])
            assert torch.equal(other, torch.full((4,), 3.0))


def test_a_peer_that_ended_fails_the_op_naming_it():
    with _links(2) as comms:
        comms[1].close()
        with pytest.raises(CommError, match="group rank 1 closed its link"):
            comms[0].all_reduce(torch.ones(8))


def test_a_peer_that_never_posts_times_out():
    with _links(2, timeout=0.3) as comms:
        with pytest.raises(CommTimeoutError, match="group rank 1's part of op 1 did not come within"):
            comms[0].all_reduce(torch.ones(8))


def test_large_and_non_sum_ops_go_to_the_inner_communicator():
    with _links(2) as comms:
        c = comms[0]
        assert not c._fits(torch.ones(c.max_bytes // 4 + 1), "sum")
        assert not c._fits(torch.ones(8), "max")
        assert not c._fits(torch.ones(8, 2).t(), "sum")
        assert c._fits(torch.ones(c.max_bytes // 4), "sum")


def test_job_address_is_the_one_towards_the_master(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert job_address() == "127.0.0.1"


def test_sends_past_the_buffers_read_the_peer_meanwhile(monkeypatch):
    """With the budget lifted, both ranks post more than the kernel buffers hold before either
    waits: each blocked send reads what the other sent, so neither waits forever."""
    sent_the_slow_way = []
    send = SocketLinksCommunicator._send
    monkeypatch.setattr(
        SocketLinksCommunicator, "_send", lambda self, *a: (sent_the_slow_way.append(self.rank), send(self, *a))[1]
    )

    def body(c):
        c.budget = 1 << 40
        parts = [torch.full((c.max_bytes // 4,), float(c.rank + i)) for i in range(12)]
        handles = [c.all_reduce(t, async_op=True) for t in parts]
        for h in handles:
            h.wait()
        return parts

    with _links(2) as comms:
        for parts in _each(comms, body):
            assert all(torch.equal(t, torch.full_like(t, 2.0 * i + 1)) for i, t in enumerate(parts))
    assert sent_the_slow_way, "the buffers held everything: the case was not reached"

"""Moving a sequence's KV blocks from one model instance to another, rank to rank.

Two instances may lay the cache out differently: another tensor-parallel size splits the KV
heads differently (or replicates them, when tp exceeds the KV heads), another pipeline size
splits the layers differently. `transfer_map` is the pure arithmetic of who sends what: for
every destination rank and every (layer, KV head) it owns, exactly one source rank that holds
it. One message per (source rank, destination rank) pair carries all of a stage's blocks for
their shared layers and heads, so a stage is a handful of large messages, not one per block.

`BlockMover` is one rank's side of it: the step plan says "send these blocks of migration M"
or "receive into these", the mover copies the blocks into a contiguous buffer and sends it, or
posts the receive and scatters the buffer into the cache blocks the moment it has arrived, both
copies on a helper thread. The bytes travel over each rank's PeerLink (comm/peer/link.py), not a
shared communicator: instances are separate jobs that die and restart on their own. A follower
rank tells its driver when its share of a stage is in, so the driver's "stage done" means the
whole instance has it, and the commit never waits for (or trusts) data that is not there.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch
from loguru import logger

from dist_infer.comm.base import Handle
from dist_infer.comm.peer.link import Address, PeerLink
from dist_infer.comm.peer.recv_handle import RecvHandle
from dist_infer.engine.device_io import host_index
from dist_infer.engine.kv_cache import stacked_layers
from dist_infer.parallel.sharding import HeadLayout, stage_layers

ACK = 1 << 20  # a follower's "my share of this stage is in" message: key (migration, stage, ACK + rank)
# Up to this many bytes a stage's copies run where they are asked for (the step thread sends, the
# link's reader thread scatters) instead of on the helper thread: a paused request's last blocks
# must not wait for a thread that competes with a long prefill forward for the cores (through the
# helper that wait was most of a prefill -> decode hand-over's downtime: docs/benchmarks.md,
# "Prefill/decode disaggregation against the same ranks serving mixed").
# Small enough to fit a socket's send buffer, so an inline send to a hung peer does not block the step.
INLINE_BYTES = 1 << 20


class TransferError(RuntimeError):
    """Two instances whose caches cannot exchange blocks (another model, block size, dtype)."""


@dataclass(frozen=True)
class KVLayout:
    """How one instance lays out its KV cache over its ranks (rank = tp index + tp * pp index)."""

    tp: int
    pp: int
    num_layers: int
    num_heads: int
    num_kv_heads: int

    @property
    def size(self) -> int:
        return self.tp * self.pp

    def layers_of(self, local_rank: int) -> range:
        return stage_layers(self.num_layers, self.pp, local_rank // self.tp)

    def heads_of(self, local_rank: int) -> range:
        h = HeadLayout(self.num_heads, self.num_kv_heads, self.tp, local_rank % self.tp)
        return range(h.kv_start, h.kv_start + h.kv_heads)

    def describe(self) -> str:
        return f"tp{self.tp}" + (f"pp{self.pp}" if self.pp > 1 else "")


@dataclass(frozen=True)
class Piece:
    """What one source rank sends one destination rank: these layers' K and V for these KV heads."""

    src: int  # local rank in the source instance
    dst: int  # local rank in the destination instance
    layers: range
    heads: range


def transfer_map(src: KVLayout, dst: KVLayout) -> list[Piece]:
    """Every (layer, KV head) each destination rank owns, from exactly one source rank that owns
    it. Where the source replicates a head on several ranks, destination tp rank t takes it from
    owner t mod (number of owners), so the load spreads over the replicas."""
    if (src.num_layers, src.num_heads, src.num_kv_heads) != (dst.num_layers, dst.num_heads, dst.num_kv_heads):
        raise TransferError(
            f"different models: {src.num_layers} layers, {src.num_heads}/{src.num_kv_heads} heads "
            f"vs {dst.num_layers} layers, {dst.num_heads}/{dst.num_kv_heads} heads"
        )
    pieces = []
    for d in range(dst.size):
        d_layers, d_heads = dst.layers_of(d), dst.heads_of(d)
        for stage in range(src.pp):
            s_layers = src.layers_of(stage * src.tp)
            layers = range(max(d_layers.start, s_layers.start), min(d_layers.stop, s_layers.stop))
            if not layers:
                continue
            chosen: dict[int, list[int]] = {}
            for h in d_heads:
                owners = [t for t in range(src.tp) if h in src.heads_of(t)]
                chosen.setdefault(owners[(d % dst.tp) % len(owners)], []).append(h)
            for t, heads in sorted(chosen.items()):
                pieces.append(Piece(stage * src.tp + t, d, layers, range(heads[0], heads[-1] + 1)))
    return pieces


@dataclass(frozen=True)
class PeerInstance:
    """The other side of a migration: its index, layout, and each of its ranks' link address."""

    index: int
    tp: int
    pp: int
    addresses: tuple[Address, ...]

    @staticmethod
    def from_hello(hello) -> "PeerInstance":
        """From an instance's hello (serving/fleet/wire.Hello; read by its fields, this layer imports no serving)."""
        return PeerInstance(hello.index, hello.tp, hello.pp, tuple(tuple(a) for a in hello.addresses))


def ip_to_int(host: str) -> int:
    try:
        return int.from_bytes(socket.inet_aton(host), "big")
    except OSError:
        raise TransferError(f"KV links take IPv4 addresses; {host!r} is not one") from None


def int_to_ip(value: int) -> str:
    return socket.inet_ntoa(value.to_bytes(4, "big"))


@dataclass
class TransferOp:
    """One step-plan entry: what every rank of the instance does for a migration stage."""

    SEND, RECV, COMMIT, CANCEL = 1, 2, 3, 4
    kind: int
    migration_id: int
    stage: int = 0
    peer: Optional[PeerInstance] = None  # the other instance (SEND, RECV)
    blocks: list[int] = field(default_factory=list)  # this instance's block ids, in sequence order

    def encode(self) -> list[int]:
        p = self.peer
        peer = [-1, 0, 0, 0] if p is None else [p.index, p.tp, p.pp, len(p.addresses)]
        addresses = [] if p is None else [x for host, port in p.addresses for x in (ip_to_int(host), port)]
        return [self.kind, self.migration_id, self.stage, *peer, *addresses, len(self.blocks), *self.blocks]

    @staticmethod
    def decode(v: list[int], at: int) -> tuple["TransferOp", int]:
        kind, mid, stage, index, tp, pp, n = v[at : at + 7]
        at += 7
        addresses = tuple((int_to_ip(v[at + 2 * i]), v[at + 2 * i + 1]) for i in range(n))
        at += 2 * n
        peer = None if index < 0 else PeerInstance(index, tp, pp, addresses)
        count = v[at]
        return TransferOp(kind, mid, stage, peer, v[at + 1 : at + 1 + count]), at + 1 + count


@dataclass
class _Posted:
    kind: str  # "send", "recv" (KV into blocks), "ack" (the driver hears a follower's share is in)
    migration_id: int
    stage: int
    buffer: Optional[torch.Tensor] = None
    handle: Optional[Handle] = None
    work: Optional[Future] = None  # sends: the gather and send; receives: the scatter once it is in
    # receives: where the buffer goes once it is in (local layer indices, local head slice, block ids)
    layers: Optional[range] = None
    heads: Optional[slice] = None
    blocks: Optional[torch.Tensor] = None
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)  # a scatter's writes vs a cancel

    def done(self) -> bool:
        if self.kind == "ack":
            return self.handle.is_completed()
        return self.work is not None and self.work.done()


class BlockMover:
    """One rank's sends and receives of migrating KV blocks, driven by the step plans.

    The copies (blocks into a send buffer, a received buffer into blocks) run on a helper thread,
    so a stage of hundreds of megabytes never holds up the step loop: full blocks never change,
    and the blocks a receive fills are reserved for it, so nothing else touches them meanwhile.
    `layout` is this instance's; `local` this rank's index in it; `addresses` every rank of the
    instance's link address (a follower tells the driver, rank 0, that its share is in)."""

    def __init__(
        self,
        link: PeerLink,
        layout: KVLayout,
        local: int,
        addresses: list[Address],
        cache_layers: list,
        layer_ids: range,
    ):
        self.link, self.layout, self.local, self.addresses = link, layout, local, list(addresses)
        self.cache_layers, self.layer_ids = cache_layers, layer_ids
        self._stacked = stacked_layers(cache_layers)
        self._posted: list[_Posted] = []
        self._pending_in: dict[tuple[int, int], list] = {}  # (migration, stage) -> [receives left, failed]
        self._applied: set[tuple[int, int]] = set()  # (migration, stage) whose ops this rank has run
        self._lock = threading.Lock()
        self.failures: set[int] = set()  # migrations a transfer of which failed on this rank (or a follower)
        self.send_wait_s = 0.0  # time the step loop spent on sends (the inline ones: INLINE_BYTES)
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")

    def _peer_layout(self, peer: PeerInstance) -> KVLayout:
        own = self.layout
        return KVLayout(peer.tp, peer.pp, own.num_layers, own.num_heads, own.num_kv_heads)

    def apply(self, op: TransferOp) -> None:
        if op.kind in (TransferOp.SEND, TransferOp.RECV) and self.local == 0:  # the driver reports stages
            self._applied.add((op.migration_id, op.stage))
        if op.kind == TransferOp.SEND:
            self._post_sends(op)
        elif op.kind == TransferOp.RECV:
            self._post_recvs(op)
        elif op.kind == TransferOp.COMMIT:
            self.complete(op.migration_id)
        elif op.kind == TransferOp.CANCEL:
            self._cancel(op.migration_id)
        else:
            raise TransferError(f"unknown transfer op {op.kind}")
        self.poll()

    def _own_heads(self, heads: range) -> slice:
        mine = self.layout.heads_of(self.local)
        return slice(heads.start - mine.start, heads.stop - mine.start)

    def _own_layers(self, layers: range) -> range:
        return range(layers.start - self.layer_ids.start, layers.stop - self.layer_ids.start)

    def _buffer(self, layers: int, blocks: int, heads: int) -> torch.Tensor:
        k0 = self.cache_layers[0][0]
        return torch.empty((layers, 2, blocks, k0.shape[1], heads, k0.shape[3]), dtype=k0.dtype, device=k0.device)

    def _block_index(self, blocks: list[int]) -> torch.Tensor:
        """The blocks' ids on the cache's device, where the gather and the scatter index with them."""
        return host_index(blocks, self.cache_layers[0][0].device)

    def _post_sends(self, op: TransferOp) -> None:
        index = self._block_index(op.blocks)
        for piece in transfer_map(self.layout, self._peer_layout(op.peer)):
            if piece.src != self.local:
                continue
            hs = self._own_heads(piece.heads)
            buffer = self._buffer(len(piece.layers), len(op.blocks), len(piece.heads))
            to = op.peer.addresses[piece.dst]

            def gather_and_send(piece=piece, hs=hs, buffer=buffer, to=to) -> None:
                # buffer: [layers, 2 (K, V), blocks, block_size, heads, head_dim]
                layers = self._own_layers(piece.layers)
                if self._stacked is not None:
                    torch.index_select(self._stacked[layers.start : layers.stop, :, :, :, hs], 2, index, out=buffer)
                else:
                    for i, layer in enumerate(layers):
                        k, v = self.cache_layers[layer]
                        torch.index_select(k[:, :, hs], 0, index, out=buffer[i, 0])
                        torch.index_select(v[:, :, hs], 0, index, out=buffer[i, 1])
                self.link.send(buffer, to, (op.migration_id, op.stage, self.local))

            started = time.perf_counter()
            work = self._copy(buffer, gather_and_send)  # a small stage's copy and send run here and now
            self.send_wait_s += time.perf_counter() - started
            self._posted.append(_Posted("send", op.migration_id, op.stage, buffer, work=work))

    def _post_recvs(self, op: TransferOp) -> None:
        index = self._block_index(op.blocks)
        pieces = transfer_map(self._peer_layout(op.peer), self.layout)
        mine = [p for p in pieces if p.dst == self.local]
        key = (op.migration_id, op.stage)
        self._pending_in[key] = [len(mine), False]
        for piece in mine:
            buffer = self._buffer(len(piece.layers), len(op.blocks), len(piece.heads))
            p = _Posted(
                "recv",
                op.migration_id,
                op.stage,
                buffer,
                layers=self._own_layers(piece.layers),
                heads=self._own_heads(piece.heads),
                blocks=index,
            )
            self._posted.append(p)
            p.handle = self.link.irecv(
                buffer,
                op.peer.addresses[piece.src],
                (op.migration_id, op.stage, piece.src),
                on_done=lambda h, p=p: self._arrived(p, h),
            )
        if self.local == 0:  # the driver: each follower's word that its share is in
            for d in sorted({p.dst for p in pieces} - {0}):
                flag = torch.zeros(1, dtype=torch.long)
                self._posted.append(
                    _Posted(
                        "ack",
                        op.migration_id,
                        op.stage,
                        flag,
                        handle=self.link.irecv(flag, self.addresses[d], (op.migration_id, op.stage, ACK + d)),
                    )
                )

    def _arrived(self, p: _Posted, handle: RecvHandle) -> None:
        p.work = self._copy(p.buffer, self._scatter, p, handle)

    def _copy(self, buffer: torch.Tensor, fn, *args) -> Future:
        """Run a stage's copy: here and now up to INLINE_BYTES, else on the helper thread. Either
        way the future holds its outcome (a failure is the stage's, recorded by poll)."""
        if buffer.numel() * buffer.element_size() > INLINE_BYTES:
            return self._copier.submit(fn, *args)
        work: Future = Future()
        try:
            work.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - recorded as the stage's failure by poll
            work.set_exception(exc)
        return work

    def _scatter(self, p: _Posted, handle: RecvHandle) -> None:
        ok = False
        try:
            with p.lock:  # a cancel (whose blocks are then freed and reused) waits for the writes, or skips them
                if not p.cancelled:
                    handle.wait(0)  # raises if it failed; copies a staged (device) buffer into place
                    if self._stacked is not None:
                        into = self._stacked[p.layers.start : p.layers.stop, :, :, :, p.heads]
                        into.index_copy_(2, p.blocks, p.buffer)
                    else:
                        for i, layer in enumerate(p.layers):
                            k, v = self.cache_layers[layer]
                            k[:, :, p.heads][p.blocks] = p.buffer[i, 0]
                            v[:, :, p.heads][p.blocks] = p.buffer[i, 1]
                    ok = True
        finally:
            self._share_done(p, ok)

    def _share_done(self, p: _Posted, ok: bool) -> None:
        """One receive of a stage is over; the last one of this rank tells the driver."""
        with self._lock:
            entry = self._pending_in.get((p.migration_id, p.stage))
            if entry is None:
                return
            entry[0] -= 1
            entry[1] = entry[1] or not ok
            last = entry[0] <= 0
        if last and self.local != 0 and not p.cancelled:
            try:
                self.link.send(
                    torch.tensor([0 if entry[1] else 1], dtype=torch.long),
                    self.addresses[0],
                    (p.migration_id, p.stage, ACK + self.local),
                )
            except Exception as exc:  # noqa: BLE001 - the driver is gone: its instance is ending anyway
                logger.warning(f"migration {p.migration_id} stage {p.stage}: could not tell the driver: {exc}")

    def _cancel(self, migration_id: int) -> None:
        for p in self._posted:
            if p.migration_id == migration_id and p.kind != "send":
                with p.lock:
                    p.cancelled = True  # it may still arrive; it is then dropped, not scattered
        self.link.drop(migration_id)
        self._applied = {k for k in self._applied if k[0] != migration_id}

    def poll(self) -> None:
        """Let go of what is done, recording failures (the orchestrator undoes those migrations)."""
        still = []
        for p in self._posted:
            if not p.done():
                still.append(p)
            elif not p.cancelled:
                self._check(p)
        self._posted = still
        with self._lock:
            live = {(p.migration_id, p.stage) for p in still if p.kind == "recv"}
            self._pending_in = {k: v for k, v in self._pending_in.items() if k in live or v[0] > 0}

    def _check(self, p: _Posted) -> None:
        try:
            if p.kind == "ack":
                p.handle.wait(0)
                if int(p.buffer[0]) != 1:
                    raise TransferError("a follower rank's share of it failed")
            else:
                p.work.result(0)
        except Exception as exc:  # noqa: BLE001 - a migration's transfer must not end the instance
            self.failures.add(p.migration_id)
            logger.warning(f"migration {p.migration_id} stage {p.stage}: transfer failed: {exc}")

    def complete(self, migration_id: int, timeout: Optional[float] = None) -> None:
        """The commit: every receive of the migration is in and scattered (the orchestrator has
        waited for the whole instance's stage reports before committing, so this does not wait
        long); the sequence runs next."""
        limit = self.link.timeout if timeout is None else timeout
        for p in self._posted:
            if p.migration_id == migration_id and p.kind == "recv":
                try:
                    p.handle.wait(limit)
                    for _ in range(1000):  # the callback that starts the scatter is a moment behind
                        if p.work is not None:
                            break
                        threading.Event().wait(0.001)
                    if p.work is None:
                        raise TransferError("the scatter of a received stage never started")
                    p.work.result(limit)
                except Exception as exc:  # noqa: BLE001 - logged; the orchestrator saw the stage fail
                    self.failures.add(migration_id)
                    logger.error(f"migration {migration_id}: committed with a receive that failed: {exc}")
        self.poll()
        if not any(p.migration_id == migration_id for p in self._posted):
            self.link.drop(migration_id)  # it is over: stray or late messages for it are freed, not held

    def stage_done(self, migration_id: int, stage: int) -> bool:
        """This rank's sends and receives of that stage are complete (receives scattered), and on
        the driver, every follower has said so of its own."""
        self.poll()
        if (migration_id, stage) not in self._applied:
            return False  # its op is still waiting for the next plan: nothing is posted yet
        if any(p.migration_id == migration_id and p.stage == stage for p in self._posted):
            return False
        self._applied.discard((migration_id, stage))
        return True

    @property
    def busy(self) -> bool:
        return bool(self._posted)

    def close(self) -> None:
        self._copier.shutdown(wait=False)

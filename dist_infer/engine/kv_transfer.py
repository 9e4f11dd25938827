"""Moving a sequence's KV blocks from one model instance to another, rank to rank.

Two instances may lay the cache out differently: another tensor-parallel size splits the KV
heads differently (or replicates them, when tp exceeds the KV heads), another pipeline size
splits the layers differently. `transfer_map` is the pure arithmetic of who sends what: for
every destination rank and every (layer, KV head) it owns, exactly one source rank that holds
it. One message per (source rank, destination rank) pair carries all of a stage's blocks for
their shared layers and heads, so a stage is a handful of large messages, not one per block.

`BlockMover` is one rank's side of it: the step plan says "send these blocks of migration M"
or "receive into these", the mover copies the blocks into a contiguous buffer and posts the
send, or posts the receive and scatters the buffer into the cache blocks once it has arrived,
both copies on a helper thread. Nothing blocks the step loop but the commit, which waits for
what is still on the way.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch
from loguru import logger

from dist_infer.comm.base import Communicator, Handle
from dist_infer.parallel.sharding import HeadLayout, stage_layers

TAG_BASE = 1000  # keeps migration tags clear of the pipeline's
TAG_STAGES = 32  # stages per migration that get their own tag


class TransferError(RuntimeError):
    """Two instances whose caches cannot exchange blocks (another model, block size, dtype)."""


@dataclass(frozen=True)
class KVLayout:
    """How one instance lays out its KV cache over its ranks (rank = tp index + tp * pp index)."""

    base_rank: int  # the instance's first world rank
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
        raise TransferError(f"different models: {src.num_layers} layers, {src.num_heads}/{src.num_kv_heads} heads "
                            f"vs {dst.num_layers} layers, {dst.num_heads}/{dst.num_kv_heads} heads")
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


def migration_tag(migration_id: int, stage: int) -> int:
    """The message tag of one stage of one migration (MPI guarantees tags up to 32767)."""
    if not 0 <= stage < TAG_STAGES:
        raise TransferError(f"stage {stage} of migration {migration_id}: at most {TAG_STAGES} stages")
    return TAG_BASE + (migration_id % 900) * TAG_STAGES + stage


@dataclass
class TransferOp:
    """One step-plan entry: what every rank of the instance does for a migration stage."""

    SEND, RECV, COMMIT, CANCEL = 1, 2, 3, 4
    kind: int
    migration_id: int
    stage: int = 0
    peer: int = 0  # the other instance's index
    blocks: list[int] = field(default_factory=list)  # this instance's block ids, in sequence order

    def encode(self) -> list[int]:
        return [self.kind, self.migration_id, self.stage, self.peer, len(self.blocks), *self.blocks]

    @staticmethod
    def decode(v: list[int], at: int) -> tuple["TransferOp", int]:
        kind, mid, stage, peer, n = v[at:at + 5]
        return TransferOp(kind, mid, stage, peer, v[at + 5:at + 5 + n]), at + 5 + n


@dataclass
class _Posted:
    migration_id: int
    stage: int
    buffer: Optional[torch.Tensor] = None
    handle: Optional[Handle] = None
    work: Optional[Future] = None  # the copy into the buffer and the send (sends), the scatter (receives)
    # receives: where the buffer goes once it is in (local layer indices, local head slice, block ids)
    layers: Optional[range] = None
    heads: Optional[slice] = None
    blocks: Optional[torch.Tensor] = None
    cancelled: bool = False

    def sent(self) -> bool:
        return self.work.done() and (self.work.exception() is not None or self.work.result().is_completed())


class BlockMover:
    """One rank's sends and receives of migrating KV blocks, driven by the step plans.

    The copies (blocks into a send buffer, a received buffer into blocks) run on a helper thread,
    so a stage of hundreds of megabytes never holds up the step loop: full blocks never change,
    and the blocks a receive fills are reserved for it, so nothing else touches them meanwhile.
    `layouts[i]` is instance i's KVLayout; `me` this rank's instance; `world` the communicator
    every instance's ranks share (peers are addressed by world rank)."""

    def __init__(self, world: Communicator, layouts: list[KVLayout], me: int, cache_layers: list,
                 layer_ids: range):
        self.world, self.layouts, self.me = world, layouts, me
        self.local = world.rank - layouts[me].base_rank
        self.cache_layers, self.layer_ids = cache_layers, layer_ids
        self._sends: list[_Posted] = []
        self._recvs: list[_Posted] = []
        self.failures: set[int] = set()  # migrations a transfer of which failed on this rank
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy")

    def apply(self, op: TransferOp) -> None:
        if op.kind == TransferOp.SEND:
            self._post_sends(op)
        elif op.kind == TransferOp.RECV:
            self._post_recvs(op)
        elif op.kind == TransferOp.COMMIT:
            self.complete(op.migration_id)
        elif op.kind == TransferOp.CANCEL:
            for p in self._recvs:
                if p.migration_id == op.migration_id:
                    p.cancelled = True  # it may still arrive; it is then dropped, not scattered
        else:
            raise TransferError(f"unknown transfer op {op.kind}")
        self.poll()

    def _pieces(self, src: int, dst: int) -> list[Piece]:
        return transfer_map(self.layouts[src], self.layouts[dst])

    def _own_heads(self, heads: range) -> slice:
        mine = self.layouts[self.me].heads_of(self.local)
        return slice(heads.start - mine.start, heads.stop - mine.start)

    def _own_layers(self, layers: range) -> range:
        return range(layers.start - self.layer_ids.start, layers.stop - self.layer_ids.start)

    def _buffer(self, layers: int, blocks: int, heads: int) -> torch.Tensor:
        k0 = self.cache_layers[0][0]
        return torch.empty((layers, 2, blocks, k0.shape[1], heads, k0.shape[3]), dtype=k0.dtype, device=k0.device)

    def _post_sends(self, op: TransferOp) -> None:
        index = torch.tensor(op.blocks, dtype=torch.long)
        peer = self.layouts[op.peer]
        tag = migration_tag(op.migration_id, op.stage)
        for piece in self._pieces(self.me, op.peer):
            if piece.src != self.local:
                continue
            hs = self._own_heads(piece.heads)
            buffer = self._buffer(len(piece.layers), len(op.blocks), len(piece.heads))

            def gather_and_send(piece=piece, hs=hs, buffer=buffer) -> Handle:
                # buffer: [layers, 2 (K, V), blocks, block_size, heads, head_dim]
                for i, layer in enumerate(self._own_layers(piece.layers)):
                    k, v = self.cache_layers[layer]
                    torch.index_select(k[:, :, hs], 0, index, out=buffer[i, 0])
                    torch.index_select(v[:, :, hs], 0, index, out=buffer[i, 1])
                return self.world.isend(buffer, peer.base_rank + piece.dst, tag)

            self._sends.append(_Posted(op.migration_id, op.stage, buffer, work=self._copier.submit(gather_and_send)))

    def _post_recvs(self, op: TransferOp) -> None:
        index = torch.tensor(op.blocks, dtype=torch.long)
        peer = self.layouts[op.peer]
        tag = migration_tag(op.migration_id, op.stage)
        for piece in self._pieces(op.peer, self.me):
            if piece.dst != self.local:
                continue
            buffer = self._buffer(len(piece.layers), len(op.blocks), len(piece.heads))
            handle = self.world.irecv(buffer, peer.base_rank + piece.src, tag)
            self._recvs.append(_Posted(op.migration_id, op.stage, buffer, handle=handle,
                                       layers=self._own_layers(piece.layers), heads=self._own_heads(piece.heads),
                                       blocks=index))

    def _scatter(self, p: _Posted) -> None:
        if p.cancelled:
            return
        for i, layer in enumerate(p.layers):
            k, v = self.cache_layers[layer]
            k[:, :, p.heads][p.blocks] = p.buffer[i, 0]
            v[:, :, p.heads][p.blocks] = p.buffer[i, 1]

    def poll(self) -> None:
        """Start scattering what has arrived; let go of what is done."""
        for p in self._recvs:
            if p.work is None and p.handle.is_completed():
                if self._failed(p, lambda: p.handle.wait(0)):
                    p.cancelled = True  # nothing arrived: the blocks stay as they were
                p.work = self._copier.submit(self._scatter, p)
        self._recvs = [p for p in self._recvs if not (p.work is not None and p.work.done() and self._settle(p))]
        self._sends = [p for p in self._sends if not (p.sent() and self._settle(p))]

    def _settle(self, p: _Posted) -> bool:
        """A finished copy and transfer: a failure (the peer died) is logged and the stage counts as
        over; the orchestrator, which sees the peer gone, undoes the migration. The step loop goes on."""
        self._failed(p, lambda: (p.handle or p.work.result()).wait(0))
        return True

    def _failed(self, p: _Posted, check) -> bool:
        try:
            check()
            return False
        except Exception as exc:  # noqa: BLE001 - a migration's transfer must not end the instance
            self.failures.add(p.migration_id)
            logger.warning(f"migration {p.migration_id} stage {p.stage}: transfer failed: {exc}")
            return True

    def complete(self, migration_id: int, timeout: Optional[float] = None) -> None:
        """Wait for every receive of a migration and its scatter (the commit: the sequence runs next)."""
        still = []
        for p in self._recvs:
            if p.migration_id == migration_id:
                p.handle.wait(timeout)
                if p.work is None:
                    p.work = self._copier.submit(self._scatter, p)
                p.work.result(timeout)
            else:
                still.append(p)
        self._recvs = still

    def stage_done(self, migration_id: int, stage: int) -> bool:
        """This rank's sends and receives of that stage are complete (and the receives scattered)."""
        self.poll()
        return not any(p.migration_id == migration_id and p.stage == stage for p in self._sends + self._recvs)

    @property
    def busy(self) -> bool:
        return bool(self._sends or self._recvs)

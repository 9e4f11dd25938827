"""The buddy side of KV mirroring, on an instance's driver (the step loop's thread).

Another instance's requests' blocks arrive here while they run there, and enter this instance's
prefix cache under their hashes, each held by a lease of (source instance, request id) until the
front end releases it (the request ended, moved, or failed over here and runs on these very
blocks). A failover then finds them as a prefix-cache hit: only the tail is computed again.

Leases never take a block a running request needs: a round reserves only free or evictable
blocks, within `fraction` of the cache, and a block only leases hold stays allocatable (the
pool reclaims it, oldest first, before any request would be preempted: engine/block_pool.py).
A reclaimed block ends its lease there: the lease keeps the blocks before it, which still
make a prefix, and lets go of the ones after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from dist_infer.engine.kv_transfer import PeerInstance, TransferOp
from dist_infer.engine.mirror.entries import LONG_REQUEST_TOKENS, MIRROR_STAGE, MirrorAnswer, MirrorEntry, report_stage
from dist_infer.engine.prefix_cache import request_block_hashes

Reply = Callable[[object], None]
LeaseKey = tuple[int, str]  # (source instance, request id)


@dataclass
class _Pending:
    """One block a round brings: a received one (`fresh`, private until committed) or one this
    cache had already (leased at once, so it is not evicted meanwhile)."""

    key: LeaseKey
    block: int
    block_hash: int
    fresh: bool
    dropped: bool = False  # an already-held block the pool reclaimed before the commit


@dataclass
class Tail:
    """A request's partial last block: block `index` of its sequence, its first rows' KV (the rows of
    `tokens`) in `block`, a private block of this instance's (a new one each round it changes)."""

    index: int
    block: int
    tokens: tuple[int, ...]


@dataclass
class _Round:
    pending: list[_Pending]
    tails: dict = field(default_factory=dict)  # lease key -> the Tail this round brings
    receiving: bool = False


@dataclass
class StoreCounters:
    blocks_received: int = 0
    blocks_already_held: int = 0
    blocks_refused: int = 0  # offered when the cache had no spare block (or the fraction was reached)
    blocks_reclaimed: int = 0  # leased blocks taken back for this instance's own requests
    leases_released: int = 0
    tails_taken_over: int = 0  # failovers that ran on from a mirrored partial block (nothing of it recomputed)


class MirrorStore:
    """The leases this instance holds for its buddies' requests, and the rounds arriving."""

    def __init__(self, engine, notify: Callable[..., None]):
        self.engine, self.notify = engine, notify
        self._leases: dict[LeaseKey, list[int]] = {}  # in sequence order
        self._tails: dict[LeaseKey, Tail] = {}  # the partial block after a lease's blocks
        self._rounds: dict[int, _Round] = {}
        self.counters = StoreCounters()
        self._pool = None

    @property
    def pool(self):
        pool = self.engine.scheduler.allocator
        if pool is not self._pool:  # the scheduler's pool (made with the cache): reclaims go through us
            pool.on_reclaim = self._on_reclaim
            self._pool = pool
        return pool

    # -- a round -----------------------------------------------------------------------------------
    def reserve(
        self, mid: int, source: PeerInstance, entries: Sequence[MirrorEntry], fraction: float, reply: Reply
    ) -> None:
        """Take what each entry brings, block by block, while there is room: a hash this cache
        holds is leased as it is, any other gets a fresh block its KV is received into (one
        receive op for the round). Answers a MirrorAnswer per entry."""
        pool, s = self.pool, self.engine.scheduler
        cap = int(fraction * pool.num_blocks)
        spare = pool.num_unleased_free - s.watermark_blocks
        rnd, answers, fresh = _Round([]), [], []
        for entry in entries:
            key = (source.index, entry.request_id)
            have = len(self._leases.get(key, ())) + sum(1 for p in rnd.pending if p.key == key)
            if entry.first != have:  # the lease was cut short here: the source offers from `have` again
                answers.append(MirrorAnswer((), min(have, entry.first)))
                continue
            send = []
            for h in entry.hashes:
                cached = pool.lookup(h)
                if cached is not None:
                    spare -= 1 if pool.refcount(cached) == 0 else 0
                    pool.lease(cached)
                    rnd.pending.append(_Pending(key, cached, h, False))
                    send.append(False)
                elif spare > 0 and pool.num_leased + len(fresh) < cap:
                    block = pool.allocate()
                    spare -= 1
                    fresh.append(block)
                    rnd.pending.append(_Pending(key, block, h, True))
                    send.append(True)
                else:
                    self.counters.blocks_refused += len(entry.hashes) - len(send)
                    break
            tail = bool(entry.tail) and len(send) == len(entry.hashes) and spare > 0
            if tail:  # the partial block after them (counted with the leases: it is theirs)
                block = pool.allocate()
                spare -= 1
                fresh.append(block)
                rnd.tails[key] = Tail(entry.first + len(send), block, tuple(entry.tail))
            answers.append(MirrorAnswer(tuple(send), have + len(send), tail))
        self._rounds[mid] = rnd
        if fresh:
            self.engine.queue_transfer(TransferOp(TransferOp.RECV, mid, MIRROR_STAGE, source, fresh))
            rnd.receiving = True
        else:
            self.notify("stage_done", mid, MIRROR_STAGE)
        reply(answers)

    def commit(self, mid: int, reply: Reply) -> None:
        """Every rank has the round's blocks: they enter the prefix cache under their hashes, leased."""
        rnd = self._rounds.pop(mid, None)
        if rnd is None:
            return reply(False)
        pool = self.pool
        self.engine.queue_transfer(TransferOp(TransferOp.COMMIT, mid))
        cut: set[LeaseKey] = set()  # requests whose run broke at a reclaimed block: the rest goes back
        for p in rnd.pending:
            block = p.block
            if p.dropped or p.key in cut:
                cut.add(p.key)
                if p.fresh:
                    pool.free([block])
                elif not p.dropped:
                    pool.unlease(block)
                continue
            if p.fresh:
                if not pool.register(block, p.block_hash):  # this cache computed the same block meanwhile
                    block = pool.lookup(p.block_hash)
                pool.lease(block)
                pool.free([p.block])  # the allocation's reference: the lease holds it now
                self.counters.blocks_received += 1
            else:
                self.counters.blocks_already_held += 1
            self._leases.setdefault(p.key, []).append(block)
        for key, tail in rnd.tails.items():
            if key in cut or tail.index != len(self._leases.get(key, ())):
                pool.free([tail.block])  # its lease broke off before it: it follows nothing
                continue
            old = self._tails.pop(key, None)
            if old is not None:
                pool.free([old.block])
            self._tails[key] = tail
        reply(True)

    def cancel(self, mid: int, reply: Optional[Reply] = None) -> None:
        """The round failed: what it reserved goes back."""
        rnd = self._rounds.pop(mid, None)
        if rnd is not None:
            self.engine.queue_transfer(TransferOp(TransferOp.CANCEL, mid))
            for p in rnd.pending:
                if p.fresh:
                    self.pool.free([p.block])
                elif not p.dropped:
                    self.pool.unlease(p.block)
            self.pool.free([t.block for t in rnd.tails.values()])
        if reply is not None:
            reply(True)

    # -- leases --------------------------------------------------------------------------------------
    def release(self, source: int, request_ids: Optional[Sequence[str]] = None) -> int:
        """End the leases of these requests of `source` (None: all of its); their blocks stay cached
        (evictable). Answers how many leases ended."""
        keys = [k for k in self._leases if k[0] == source and (request_ids is None or k[1] in request_ids)]
        for key in keys:
            for block in self._leases.pop(key):
                self.pool.unlease(block)
            self._drop_tail(key)
        self.counters.leases_released += len(keys)
        return len(keys)

    def _drop_tail(self, key: LeaseKey) -> None:
        tail = self._tails.pop(key, None)
        if tail is not None:
            self.pool.free([tail.block])

    @property
    def holds_long_request(self) -> bool:
        """Whether a request of LONG_REQUEST_TOKENS or more has its blocks mirrored here: its failover
        would run here at the next step, so this instance's steps of prompts alone are paced too."""
        blocks = -(-LONG_REQUEST_TOKENS // self.engine.scheduler.config.block_size)
        return any(len(held) >= blocks for held in self._leases.values())

    def take_over(self, request) -> bool:
        """A request failed over here (`request`, resumed from its client's tokens, not queued yet):
        if its partial block is here after its leased blocks, it runs on from them with nothing
        computed again but the tokens after the mirror; False (nothing done) otherwise: it is then
        queued, and the prefix cache finds its leased full blocks."""
        key = next((k for k in self._tails if k[1] == request.request_id), None)
        if key is None:
            return False
        tail, lease, bs = self._tails[key], self._leases.get(key, []), self.engine.block_size
        start = tail.index * bs
        tokens = request.all_token_ids
        matched = self.pool.match(request_block_hashes(request, tail.index, bs)) if tail.index else []
        if (
            len(lease) != tail.index
            or matched != lease
            or tuple(tokens[start : start + len(tail.tokens)]) != tail.tokens
            or start + len(tail.tokens) >= len(tokens)  # the last token's KV is computed by its next step
        ):
            return False
        del self._tails[key]
        self.pool.take(lease)
        request.num_computed, request.num_cached_blocks = start + len(tail.tokens), tail.index
        s = self.engine.scheduler
        s.failover_recomputed_tokens += len(tokens) - request.num_computed
        self.engine.registry.count_added()  # the front end counted it as an add to this instance
        self.engine.registry.register(request)
        s.install(request, lease + [tail.block], computed_here=True)
        self.counters.tails_taken_over += 1
        return True

    def held_for(self, source: int, request_id: str) -> int:
        return len(self._leases.get((source, request_id), ()))

    def _on_reclaim(self, block: int) -> None:
        """The pool needs this block (only leases hold it): every lease on it ends there."""
        for rnd in self._rounds.values():
            for p in rnd.pending:
                if p.block == block and not p.fresh and not p.dropped:
                    p.dropped = True
                    self.pool.unlease(block)
        for key, blocks in list(self._leases.items()):
            if block not in blocks:
                continue
            at = blocks.index(block)
            for b in blocks[at:]:
                self.pool.unlease(b)
            self.counters.blocks_reclaimed += len(blocks) - at
            self._drop_tail(key)
            if at:
                self._leases[key] = blocks[:at]
            else:
                del self._leases[key]

    def poll(self) -> None:
        """Report the rounds whose blocks are in (on the driver: every rank's share)."""
        for mid, rnd in self._rounds.items():
            if rnd.receiving and report_stage(self.engine.mover, mid, self.notify):
                rnd.receiving = False

    @property
    def busy(self) -> bool:
        return any(r.receiving for r in self._rounds.values())

    def snapshot(self) -> dict:
        c = self.counters
        return {
            "blocks_received": c.blocks_received,
            "blocks_already_held": c.blocks_already_held,
            "blocks_refused": c.blocks_refused,
            "blocks_reclaimed": c.blocks_reclaimed,
            "leases": len(self._leases),
            "leased_blocks": self.pool.num_leased if self.engine.scheduler is not None else 0,
            # of those, the blocks of committed rounds: what a failover here finds (a round's leases
            # start at its reserve; a source dying before the commit undoes them)
            "committed_blocks": sum(len(blocks) for blocks in self._leases.values()),
            "leases_released": c.leases_released,
            "tails": len(self._tails),
            "tails_taken_over": c.tails_taken_over,
        }

"""The source side of KV mirroring, on an instance's driver (the step loop's thread).

A round, driven by the front end (serving/mirror/mirror_rounds.py): `offer` names the full
blocks of running requests that the buddy does not have yet (holding them, so that no block is
freed and reused while it is read), `send` queues the blocks the buddy asked for as one transfer
op every rank makes with the next plan (the copies run beside the steps, engine/kv_transfer.py),
and `done` lets go of the held blocks and, if the buddy committed, records how far each request
is mirrored. Nothing here ever waits: a step never waits on a mirror.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from dist_infer.engine.kv_transfer import PeerInstance, TransferOp
from dist_infer.engine.mirror.entries import MIRROR_STAGE, MirrorAnswer, MirrorEntry
from dist_infer.engine.prefix_cache import request_block_hashes
from dist_infer.engine.request import RequestStatus

Reply = Callable[[object], None]


@dataclass
class _Round:
    buddy: int
    entries: list[MirrorEntry]
    blocks: list[list[int]]  # per entry: this instance's blocks offered (held until done)
    answers: Optional[list[MirrorAnswer]] = None
    sending: bool = False


@dataclass
class SourceCounters:
    blocks_sent: int = 0
    rounds: int = 0
    lag_samples: dict = field(default_factory=dict)  # lag in blocks (per request, at each offer) -> count


class MirrorSource:
    """Which leading blocks of each live request the buddy holds, and the round in flight."""

    def __init__(self, engine, notify: Callable[..., None]):
        self.engine, self.notify = engine, notify
        self.buddy: Optional[int] = None
        self._have: dict[str, int] = {}  # request id -> leading blocks the buddy holds
        self._rounds: dict[int, _Round] = {}
        self.counters = SourceCounters()
        self.step_wait_s = 0.0  # time the step loop's thread spent in these calls

    @property
    def scheduler(self):
        return self.engine.scheduler

    def _full_blocks(self, r) -> int:
        return min(r.num_computed // self.engine.block_size, len(r.block_table))

    def lag(self) -> tuple[int, int]:
        """(blocks computed but not mirrored over the running requests, the most of one request)."""
        lags = [self._full_blocks(r) - self._have.get(r.request_id, 0) for r in self.scheduler.running]
        lags = [max(0, x) for x in lags] or [0]
        return sum(lags), max(lags)

    def offer(self, mid: int, buddy: PeerInstance, max_blocks: int, reply: Reply) -> None:
        """Name up to `max_blocks` full blocks the buddy lacks (oldest requests first), and hold them."""
        t0 = time.perf_counter()
        if buddy.index != self.buddy:  # a new buddy holds nothing of ours
            self.buddy, self._have = buddy.index, {}
        live = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        self._have = {k: v for k, v in self._have.items() if k in live}
        busy = {e.request_id for rnd in self._rounds.values() for e in rnd.entries}
        entries, blocks, left = [], [], max_blocks
        bs = self.engine.block_size
        for r in self.scheduler.running:
            if r.status is not RequestStatus.RUNNING or r.request_id in busy:
                continue
            full, have = self._full_blocks(r), self._have.get(r.request_id, 0)
            lag = max(0, full - have)
            self.counters.lag_samples[lag] = self.counters.lag_samples.get(lag, 0) + 1
            n = min(lag, left)
            if n <= 0:
                continue
            hashes = request_block_hashes(r, have + n, bs)[have:]
            entries.append(MirrorEntry(r.request_id, have, tuple(hashes)))
            blocks.append(list(r.block_table[have : have + n]))
            left -= n
        for held in blocks:
            self.scheduler.allocator.take(held)
        if entries:
            self._rounds[mid] = _Round(buddy.index, entries, blocks)
        self.step_wait_s += time.perf_counter() - t0
        reply(entries)

    def send(self, mid: int, answers: Sequence[MirrorAnswer], peer: PeerInstance, reply: Reply) -> None:
        """Queue the blocks the buddy asked for (one op; every rank sends its share); answers how many."""
        rnd = self._rounds.get(mid)
        if rnd is None or len(answers) != len(rnd.entries):
            return reply(ValueError(f"mirror round {mid} is not known here, or its answers do not fit it"))
        rnd.answers = list(answers)
        chosen = [b for held, a in zip(rnd.blocks, answers) for b, send in zip(held, a.send) if send]
        if chosen:
            self.engine.queue_transfer(TransferOp(TransferOp.SEND, mid, MIRROR_STAGE, peer, chosen))
            rnd.sending = True
        else:
            self.notify("stage_done", mid, MIRROR_STAGE)
        reply(len(chosen))

    def done(self, mid: int, committed: bool, reply: Reply) -> None:
        """The round is over: let go of its blocks; if the buddy committed, the requests are mirrored that far."""
        rnd = self._rounds.pop(mid, None)
        if rnd is None:
            return reply(False)
        for held in rnd.blocks:
            self.scheduler.allocator.free(held)
        if rnd.answers is not None and rnd.buddy == self.buddy:
            sent = 0
            for entry, answer in zip(rnd.entries, rnd.answers):
                if committed or answer.have < entry.first:  # (a rewind holds, committed or not)
                    self._have[entry.request_id] = answer.have
                sent += sum(answer.send) if committed else 0
            self.counters.blocks_sent += sent
            self.counters.rounds += 1 if committed else 0
        reply(True)

    def forget_buddy(self) -> None:
        """Mirroring is off, or the buddy went away: nothing is mirrored anywhere now."""
        self.buddy, self._have = None, {}

    def poll(self) -> None:
        """Report the rounds whose sends are out (this rank's share: the followers' are theirs)."""
        mover = self.engine.mover
        for mid, rnd in self._rounds.items():
            if rnd.sending and mover.stage_done(mid, MIRROR_STAGE):
                rnd.sending = False
                self.notify("stage_failed" if mid in mover.failures else "stage_done", mid, MIRROR_STAGE)

    @property
    def busy(self) -> bool:
        return any(r.sending for r in self._rounds.values())

    def snapshot(self) -> dict:
        total, most = self.lag()
        c = self.counters
        return {
            "blocks_sent": c.blocks_sent,
            "rounds": c.rounds,
            "lag_blocks": total,
            "lag_blocks_max": most,
            "lag_samples": dict(c.lag_samples),
            "buddy": self.buddy,
        }

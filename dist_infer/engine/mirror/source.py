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
from dist_infer.engine.mirror.entries import LONG_REQUEST_TOKENS, MIRROR_STAGE, MirrorAnswer, MirrorEntry, report_stage
from dist_infer.engine.prefix_cache import request_block_hashes
from dist_infer.engine.request import RequestStatus

Reply = Callable[[object], None]


LAG_PHASES = ("prompt", "output")  # a request's lag samples: while its prompt's blocks are among them, after


def lag_phase(prompt_blocks: int, full: int, have: int) -> str:
    """The sample's phase: "prompt" while full blocks of the prompt are not mirrored yet, else "output"."""
    return "prompt" if min(full, prompt_blocks) > have else "output"


@dataclass
class _Round:
    buddy: int
    entries: list[MirrorEntry]
    blocks: list[list[int]]  # per entry: this instance's blocks offered (held until done)
    tails: list[Optional[int]]  # per entry: its partial block offered (held until done), or None
    answers: Optional[list[MirrorAnswer]] = None
    sending: bool = False

    def held(self) -> list[int]:
        """Every block the round holds: each entry's full blocks and its partial one."""
        return [
            b for blocks, tail in zip(self.blocks, self.tails) for b in blocks + ([tail] if tail is not None else [])
        ]


@dataclass
class SourceCounters:
    blocks_sent: int = 0
    rounds: int = 0
    # per phase, lag in blocks (per request, at each offer) -> count: "prompt" while blocks of its prompt are
    # among them (a prompt's step fills many at once), "output" after (the steady state, a block per block_size tokens)
    lag_samples: dict = field(default_factory=lambda: {phase: {} for phase in LAG_PHASES})


class MirrorSource:
    """Which leading blocks of each live request the buddy holds, and the round in flight."""

    def __init__(self, engine, notify: Callable[..., None]):
        self.engine, self.notify = engine, notify
        self.buddy: Optional[int] = None
        self._have: dict[str, int] = {}  # request id -> leading blocks the buddy holds
        self._tail: dict[str, tuple[int, int]] = {}  # request id -> (its partial block's index, rows) the buddy holds
        self._rounds: dict[int, _Round] = {}
        self.counters = SourceCounters()
        self.step_wait_s = 0.0  # time the step loop's thread spent in these calls

    @property
    def scheduler(self):
        return self.engine.scheduler

    def _full_blocks(self, r) -> int:
        return min(r.num_computed // self.engine.block_size, len(r.block_table))

    def lag(self) -> tuple[int, int]:
        """(blocks computed but not mirrored over the running requests, the most of one request);
        (0, 0) while it mirrors to nobody (mirroring off, or no buddy)."""
        if self.buddy is None:
            return 0, 0
        lags = [self._full_blocks(r) - self._have.get(r.request_id, 0) for r in self.scheduler.running]
        lags = [max(0, x) for x in lags] or [0]
        return sum(lags), max(lags)

    def offer(self, mid: int, buddy: PeerInstance, max_blocks: int, reply: Reply) -> None:
        """Name up to `max_blocks` full blocks the buddy lacks (oldest requests first), and hold them."""
        t0 = time.perf_counter()
        if buddy.index != self.buddy:  # a new buddy holds nothing of ours
            self.buddy, self._have, self._tail = buddy.index, {}, {}
        live = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        self._have = {k: v for k, v in self._have.items() if k in live}
        self._tail = {k: v for k, v in self._tail.items() if k in live}
        busy = {e.request_id for other in self._rounds.values() for e in other.entries}
        rnd = _Round(buddy.index, [], [], [])
        left = max_blocks
        for r in self.scheduler.running:
            if r.status is not RequestStatus.RUNNING or r.request_id in busy:
                continue
            left -= self._offer_one(r, rnd, left)
        self.scheduler.allocator.take(rnd.held())
        if rnd.entries:
            self._rounds[mid] = rnd
        self.step_wait_s += time.perf_counter() - t0
        reply(rnd.entries)

    def _offer_one(self, r, rnd: _Round, left: int) -> int:
        """Add `r`'s unmirrored full blocks (at most `left`) and, for a long request whose full
        blocks will all be there, its partial block if it grew, to the round; the blocks it adds."""
        bs = self.engine.block_size
        full, have = self._full_blocks(r), self._have.get(r.request_id, 0)
        lag = max(0, full - have)
        samples = self.counters.lag_samples[lag_phase(len(r.prompt_token_ids) // bs, full, have)]
        samples[lag] = samples.get(lag, 0) + 1
        n = min(lag, left)
        rows = r.num_computed - full * bs
        tail = have + n == full and 0 < rows and r.num_computed >= LONG_REQUEST_TOKENS and len(r.block_table) > full
        tail = tail and self._tail.get(r.request_id) != (full, rows)
        if n <= 0 and not tail:
            return 0
        hashes = request_block_hashes(r, have + n, bs)[have:] if n > 0 else []
        tokens = tuple(r.all_token_ids[full * bs : full * bs + rows]) if tail else ()
        rnd.entries.append(MirrorEntry(r.request_id, have, tuple(hashes), tokens))
        rnd.blocks.append(list(r.block_table[have : have + n]))
        rnd.tails.append(r.block_table[full] if tail else None)
        return max(0, n)

    def send(self, mid: int, answers: Sequence[MirrorAnswer], peer: PeerInstance, reply: Reply) -> None:
        """Queue the blocks the buddy asked for (one op; every rank sends its share); answers how many."""
        rnd = self._rounds.get(mid)
        if rnd is None or len(answers) != len(rnd.entries):
            return reply(ValueError(f"mirror round {mid} is not known here, or its answers do not fit it"))
        rnd.answers = list(answers)
        chosen = []  # in the buddy's receive order: an entry's full blocks it asked for, then its tail
        for held, tail, a in zip(rnd.blocks, rnd.tails, answers):
            chosen += [b for b, send in zip(held, a.send) if send] + ([tail] if a.tail and tail is not None else [])
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
        self.scheduler.allocator.free(rnd.held())
        if rnd.answers is not None and rnd.buddy == self.buddy:
            sent = 0
            for entry, answer in zip(rnd.entries, rnd.answers):
                if committed or answer.have < entry.first:  # (a rewind holds, committed or not)
                    self._have[entry.request_id] = answer.have
                if answer.have < entry.first:  # its partial block went with the blocks it followed
                    self._tail.pop(entry.request_id, None)
                if committed and answer.tail:
                    self._tail[entry.request_id] = (entry.first + len(entry.hashes), len(entry.tail))
                sent += sum(answer.send) + answer.tail if committed else 0
            self.counters.blocks_sent += sent
            self.counters.rounds += 1 if committed else 0
        reply(True)

    def forget_buddy(self) -> None:
        """Mirroring is off, or the buddy went away: nothing is mirrored anywhere now."""
        self.buddy, self._have, self._tail = None, {}, {}

    def poll(self) -> None:
        """Report the rounds whose sends are out (this rank's share: the followers' are theirs)."""
        for mid, rnd in self._rounds.items():
            if rnd.sending and report_stage(self.engine.mover, mid, self.notify):
                rnd.sending = False

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
            "lag_samples": {phase: dict(samples) for phase, samples in c.lag_samples.items()},
            "buddy": self.buddy,
        }

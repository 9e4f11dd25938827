"""KV mirroring in the front end (--kv-mirror buddy): it pairs the instances (buddies.py), runs
each source's rounds to its buddy one after another while it has running requests
(mirror_round.py), remembers how far each request is mirrored and where, sends a request whose
instance died to the instance that holds its mirror, and ends a request's leases when it ends,
moves, or streams again after a failover (its blocks are then its own on the buddy).

Runs on the control loop, but `request_ended`, `moved`, `recovered` and `failover_target` are
called from other threads (the HTTP loop, instance readers): the records have a lock of their own.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from loguru import logger

from dist_infer.engine.migration import MigrationAborted
from dist_infer.serving.fleet.config import FleetConfig
from dist_infer.serving.fleet.control_loop import ControlLoop
from dist_infer.serving.fleet.fleet_state import FleetState
from dist_infer.serving.fleet.instance_calls import InstanceCalls
from dist_infer.serving.fleet.mirror_wire import MirrorForget, MirrorRelease
from dist_infer.serving.fleet.wire import InstanceState
from dist_infer.serving.mirror.buddies import pair_buddies
from dist_infer.serving.mirror.mirror_round import mirror_round

ROUND_BYTES = 64 << 20  # the most a round sends: the bytes in flight per source are bounded by it
# A source's rounds start at most this often: what fills meanwhile goes in one round (fewer calls and
# copier wake-ups beside the steps, which on a busy CPU cost the steps more than the bytes do)
ROUND_INTERVAL_S = 0.1


@dataclass
class MirrorRecord:
    """Where a request is mirrored: from `source` to `buddy`, its first `blocks` blocks."""

    source: int
    buddy: int
    blocks: int


class MirrorControl:
    def __init__(self, fleet: FleetState, control: ControlLoop, calls: InstanceCalls, config: FleetConfig):
        self.fleet, self.control, self.calls = fleet, control, calls
        self.enabled = config.kv_mirror == "buddy"
        self.fraction = config.kv_mirror_fraction
        self.timeout = config.migration_timeout
        self.pairs: dict[int, int] = {}
        self.records: dict[str, MirrorRecord] = {}
        self.rounds: Counter = Counter()  # ok, failed
        self.failovers_to_mirror = 0
        self._lock = threading.Lock()
        self._tasks: dict[int, asyncio.Task] = {}

    # -- the control loop ----------------------------------------------------------------------------
    def tick(self) -> None:
        """Pair the instances anew if they changed; start a source's rounds if it runs requests."""
        if not self.enabled:
            return
        self._pair()
        for src, buddy in self.pairs.items():
            task = self._tasks.get(src)
            if (task is None or task.done()) and self.fleet.instances[src].stats.num_requests_running:
                self._tasks[src] = self.control.spawn(self._rounds(src, buddy))

    def _pair(self) -> None:
        serving = [
            (c.index, c.node)
            for c in self.fleet.instances
            if c.alive and c.state is InstanceState.SERVING and c.hello is not None and c.hello.cp == 1
        ]
        pairs = pair_buddies(serving)
        if pairs == self.pairs:
            return
        for src, old in self.pairs.items():
            if pairs.get(src) != old:
                self._repaired(src, old, pairs.get(src))
        logger.info(f"KV mirror buddies (source -> buddy): {pairs or 'none'}")
        self.pairs = pairs

    def _repaired(self, src: int, old: int, new: Optional[int]) -> None:
        """`src` mirrors elsewhere now (or nowhere): what `old` holds of it is let go, unless `src`
        died (its requests fail over onto those leases; each is released once it streams again)."""
        if not self.fleet.instances[src].alive:
            return
        with self._lock:
            self.records = {r: rec for r, rec in self.records.items() if (rec.source, rec.buddy) != (src, old)}
        if self.fleet.instances[old].alive:
            self._call(old, MirrorRelease(src))
        if new is None:
            self._call(src, MirrorForget())

    async def _rounds(self, src: int, buddy: int) -> None:
        """Rounds from `src` to `buddy` until one finds nothing new (or fails, or the pair changes)."""
        max_blocks = max(1, ROUND_BYTES // max(1, self.fleet.block_bytes))
        while self.pairs.get(src) == buddy and not self.fleet.stopping:
            mid = secrets.randbits(62)
            self.calls.open_migration(mid)
            try:
                result = await mirror_round(self.calls, mid, src, buddy, self.fraction, max_blocks, self.timeout)
            finally:
                self.calls.close_migration(mid)
            self.rounds["ok" if result.ok else "failed"] += 1
            ended = []
            with self._lock:
                for request_id, blocks in result.have.items():
                    if request_id in self.fleet.requests:
                        self.records[request_id] = MirrorRecord(src, buddy, blocks)
                    else:
                        ended.append(request_id)
            if ended:  # they ended while the round ran: nobody else will end their leases
                self._call(buddy, MirrorRelease(src, tuple(ended)))
            if not result.ok or not result.offered:
                return
            await asyncio.sleep(max(0.0, ROUND_INTERVAL_S - result.seconds))

    def _call(self, index: int, op) -> None:
        """Make a call whose answer nobody needs (a dead or silent instance is no matter)."""

        async def call() -> None:
            try:
                await self.calls.call(index, op, self.timeout)
            except MigrationAborted as exc:
                logger.debug(f"KV mirror: {op.name} on instance {index}: {exc}")

        coro = call()
        try:
            self.control.submit(coro)
        except RuntimeError:  # the loop has closed: the server stops
            coro.close()

    # -- requests (any thread) --------------------------------------------------------------------------
    def failover_target(self, request_id: str) -> Optional[int]:
        """The instance holding the request's mirror, if it takes requests (its instance died)."""
        with self._lock:
            rec = self.records.get(request_id)
        if rec is None or not rec.blocks or not self.fleet.instances[rec.buddy].accepting:
            return None
        self.failovers_to_mirror += 1
        return rec.buddy

    def request_ended(self, request_id: str) -> None:
        """It ended (or moved, or streams again after a failover): its leases end."""
        with self._lock:
            rec = self.records.pop(request_id, None)
        if rec is not None and self.fleet.instances[rec.buddy].alive:
            self._call(rec.buddy, MirrorRelease(rec.source, (request_id,)))

    def snapshot(self) -> dict:
        with self._lock:
            mirrored = len(self.records)
        return {
            "mode": "buddy" if self.enabled else "off",
            "pairs": dict(self.pairs),
            "rounds": dict(self.rounds),
            "requests_mirrored": mirrored,
            "failovers_to_mirror": self.failovers_to_mirror,
        }

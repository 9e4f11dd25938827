"""Moving live requests: one migration's bookkeeping around serving/migration/live_migration.py's protocol, the
prefill/decode hand-over, and the controller that every --migrate-interval rebalances the
instances (the policy itself is serving/migration/rebalance_policy.py)."""

from __future__ import annotations

import asyncio
import secrets
import time

from loguru import logger

from dist_infer.engine.scheduler import blocks_at_full_length
from dist_infer.serving.fleet.instance_record import RequestRecord
from dist_infer.serving.fleet.lifecycle import PD_RETRY_S
from dist_infer.serving.fleet.wire import AbortRequest, InstanceState, MigrationOutcome, Role, StopInstance
from dist_infer.serving.migration.live_migration import MAX_STAGES, MigrationResult, migrate
from dist_infer.serving.migration.rebalance_policy import MoveCandidate, plan_moves

TICK_S = 0.05  # how often the controller looks at draining and stopping instances


class MigrationControl:
    """Cluster's part that moves requests between instances."""

    def abort_on(self, index: int, request_id: str) -> None:
        """End a request on one instance, whatever the API's routing says (a late copy of it), and
        stream nothing more from it there."""
        with self._lock:
            rec = self._requests.get(request_id)
            if rec is not None and rec.moving is not None and rec.moving[1] == index:
                rec.moving = (rec.moving[0], -1)
        if self.instances[index].alive:
            try:
                self.instances[index].send(AbortRequest(request_id))
            except OSError:
                pass

    def moved(self, request_id: str, src: int, dst: int) -> None:
        """The destination has the request: its outputs come from there now (unless its client left
        meanwhile: then nobody listens, and the destination drops it)."""
        with self._lock:
            rec = self._requests.get(request_id)
            listened = rec is not None and rec.owner == src and not rec.aborted
            if listened:
                rec.owner = dst
        if not listened:
            try:
                self.instances[dst].send(AbortRequest(request_id))
            except OSError:
                pass

    async def _migrate(self, request_id: str, src: int, dst: int, reason: str, mode: str = "live",
                       max_stages: int = MAX_STAGES) -> MigrationResult:
        mid = secrets.randbits(62)
        with self._lock:
            rec = self._requests.get(request_id)
            if rec is not None:
                rec.moving = (src, dst)
                self._expect(rec, request_id, dst)
        self._busy.update((src, dst))
        self._active_migrations.add(mid)
        try:
            result = await migrate(self, mid, request_id, src, dst, reason, self.migration_timeout, mode, max_stages)
        finally:
            self._busy.subtract((src, dst))
            self._active_migrations.discard(mid)
            with self._lock:
                self.instances[dst].incoming.pop(request_id, None)
                rec = self._requests.get(request_id)
                orphaned = None
                if rec is not None:
                    rec.moving, rec.aborted = None, False
                    if rec.owner is not None and not self.instances[rec.owner].alive:
                        orphaned = rec.owner
            for key in [k for k in self._events if k[1][1] == mid]:  # reports nobody waited for
                fut = self._events.pop(key)
                if fut.done() and not fut.cancelled():
                    fut.exception()  # retrieved: no "never retrieved" warning for a failure nobody awaited
            if orphaned is not None:  # its instance died while it moved (and the move did not save it)
                self._redispatch(request_id, f"instance {orphaned} died")
        with self._lock:
            rec = self._requests.get(request_id)
            if rec is not None:
                rec.moved_at = time.monotonic()
                if reason == "pd":
                    ok = result.outcome == MigrationOutcome.OK
                    rec.pd_next = float("inf") if ok else time.monotonic() + PD_RETRY_S
        self.outcomes[result.outcome] += 1
        self.history.append(result)
        if result.outcome == MigrationOutcome.OK:
            self.downtime.observe(result.downtime_s)
        return result

    def _expect(self, rec: RequestRecord, request_id: str, dst: int) -> None:
        """(lock held) A request on its way to `dst` counts in its load until the move is over, so
        moves chosen in the same instant spread out instead of all picking the same instance."""
        self.instances[dst].incoming[request_id] = blocks_at_full_length(
            len(rec.progress.prompt_token_ids), rec.progress.params.max_new_tokens, self.block_size, self.cp)

    def _hand_to_decode(self, request_id: str, src: int) -> None:
        """A request has its first token on a prefill instance: move it, KV and all, in one stage,
        to the decode instance with the most room (if none has room, it decodes where it is and
        tries again a little later)."""
        with self._lock:
            rec = self._requests.get(request_id)
            if rec is None:
                return
            if rec.owner != src or rec.moving is not None:
                rec.pd_next = time.monotonic() + PD_RETRY_S  # moved or moving meanwhile: looked at again later
                return
            dst = self._choose(len(rec.progress.prompt_token_ids), rec.progress.params, (Role.DECODE, Role.MIXED),
                               queued=False)
            if dst is None or dst == src:
                rec.pd_next = time.monotonic() + PD_RETRY_S
                return
            self._expect(rec, request_id, dst)  # before the migration task starts: the next choice sees it
        self.loop.create_task(self._migrate(request_id, src, dst, "pd", max_stages=0))

    async def _controller(self) -> None:
        last = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(TICK_S)
            draining = any(c.draining and c.alive for c in self.instances)
            due = self.migrate_interval > 0 and time.monotonic() - last >= self.migrate_interval
            if self.dead_reason is not None:
                continue
            try:
                if self.autoscaler is not None:
                    self.autoscaler.tick()
                self._finish_stops()
                if not (draining or due):
                    continue
                if due:
                    last = time.monotonic()
                self._rebalance(only_drain=not due)
            except Exception as exc:  # noqa: BLE001 - a bad round must not end the control loop
                logger.exception(f"migration controller: {exc}")

    def _rebalance(self, only_drain: bool) -> None:
        now = time.monotonic()
        # prefill instances hand their requests over by rule (above); the controller balances the rest
        live = [c for c in self.instances if c.alive and (c.role != Role.PREFILL or c.draining)]
        loads = [c.load() for c in live]
        with self._lock:
            moving = {r for r, rec in self._requests.items() if rec.moving is not None}
            cooling = {r for r, rec in self._requests.items() if now - rec.moved_at < self.cooldown_s}
        candidates = {}
        for c in live:
            s = c.stats
            cands = [MoveCandidate(r, 0, False) for r in s.waiting_ids]
            cands += [MoveCandidate(r, b, True) for r, b in zip(s.running_ids, s.running_blocks)]
            candidates[c.index] = [x for x in cands if x.request_id not in moving]
        draining = {c.index for c in live if c.draining}
        busy = {i for i, n in self._busy.items() if n > 0}
        if only_drain:
            loads = [x for x in loads if x.index in draining or x.accepting]
        for move in plan_moves(loads, candidates, busy, cooling, draining):
            if only_drain and move.src not in draining:
                continue
            self.loop.create_task(self._migrate(move.request_id, move.src, move.dst, move.reason))

    def _finish_stops(self) -> None:
        """A stopping instance that holds nothing any more is told to stop."""
        for c in self.instances:
            if c.state != InstanceState.STOPPING or c.stop_sent or not c.alive:
                continue
            with self._lock:
                held = any(rec.owner == c.index for rec in self._requests.values())
            s = c.stats
            if held or s.num_requests_running or s.num_requests_waiting or self._busy[c.index] > 0:
                continue
            c.stop_sent = True
            logger.info(f"instance {c.index} is drained; stopping it")
            try:
                c.send(StopInstance())
            except OSError:
                pass

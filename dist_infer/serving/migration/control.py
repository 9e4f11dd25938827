"""Moving live requests: one migration's bookkeeping around serving/migration/live_migration.py's
protocol, the prefill/decode hand-over, and the rounds in which the controller rebalances the
instances every --migrate-interval (the policy itself is serving/migration/rebalance_policy.py)."""

from __future__ import annotations

import secrets
import time
from collections import Counter, deque
from typing import Callable

from loguru import logger

from dist_infer.serving.fleet.bucket_counts import BucketCounts
from dist_infer.serving.fleet.config import FleetConfig
from dist_infer.serving.fleet.control_loop import ControlLoop
from dist_infer.serving.fleet.fleet_state import FleetState
from dist_infer.serving.fleet.instance_calls import InstanceCalls
from dist_infer.serving.fleet.instance_record import RequestRecord
from dist_infer.serving.fleet.router import Router
from dist_infer.serving.fleet.wire import AbortRequest, InstanceState, MigrationOutcome, Role, StopInstance
from dist_infer.serving.migration.live_migration import MAX_STAGES, MigrationOrder, MigrationResult, migrate
from dist_infer.serving.migration.rebalance_policy import MoveCandidate, plan_moves

PD_RETRY_S = 0.5  # a request whose hand-over to a decode instance failed tries again after this
DOWNTIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
Redispatch = Callable[[str, str], None]  # (request id, why): send a request whose instance is gone elsewhere


class MigrationControl:
    """Moves requests between instances; keeps what each migration did (outcomes, downtimes)."""

    def __init__(
        self,
        fleet: FleetState,
        control: ControlLoop,
        calls: InstanceCalls,
        router: Router,
        config: FleetConfig,
        redispatch: Redispatch,
        on_moved: Callable[[str], None] = lambda request_id: None,
        buddies: Callable[[], dict[int, int]] = dict,
    ):
        self.fleet, self.control, self.calls, self.router = fleet, control, calls, router
        self.migrate_interval, self.migration_timeout = config.migrate_interval, config.migration_timeout
        self.cooldown_s = config.cooldown
        self.redispatch = redispatch  # a request whose instance died while it moved goes on elsewhere
        self.on_moved = on_moved  # a request runs elsewhere now (its KV mirror's leases end)
        self.buddies = buddies  # where each instance's KV is mirrored: a drained instance's requests go there
        self.busy: Counter = Counter()  # instance -> migrations it takes part in
        self.outcomes: Counter = Counter()
        self.downtime = BucketCounts(DOWNTIME_BUCKETS)  # of live migrations that succeeded (seconds)
        self.history: deque[MigrationResult] = deque(maxlen=1000)
        self._last_round = time.monotonic()

    def moved(self, request_id: str, src: int, dst: int) -> None:
        """The destination has the request: its outputs come from there now (unless its client left
        meanwhile: then nobody listens, and the destination drops it)."""
        with self.fleet.lock:
            rec = self.fleet.requests.get(request_id)
            listened = False
            if rec is not None and rec.owner == src and not rec.aborted:
                rec.owner, listened = dst, True
        if not listened:
            try:
                self.fleet.instances[dst].send(AbortRequest(request_id))
            except OSError:
                pass
        self.on_moved(request_id)

    async def migrate(
        self, request_id: str, src: int, dst: int, reason: str, mode: str = "live", max_stages: int = MAX_STAGES
    ) -> MigrationResult:
        """(control loop) Move one request; what happened is counted and kept in `history`."""
        fleet, mid = self.fleet, secrets.randbits(62)
        with fleet.lock:
            rec = fleet.requests.get(request_id)
            if rec is not None:
                rec.moving = (src, dst)
                self._expect(rec, request_id, dst)
        self.busy.update((src, dst))
        self.calls.open_migration(mid)
        try:
            order = MigrationOrder(mid, request_id, src, dst, reason, mode, max_stages)
            result = await migrate(self.calls, fleet, order, self.moved, self.migration_timeout)
        finally:
            self.busy.subtract((src, dst))
            with fleet.lock:
                fleet.instances[dst].incoming.pop(request_id, None)
                rec = fleet.requests.get(request_id)
                orphaned = None
                if rec is not None:
                    rec.moving, rec.aborted = None, False
                    if rec.owner is not None and not fleet.instances[rec.owner].alive:
                        orphaned = rec.owner
            self.calls.close_migration(mid)
            if orphaned is not None:  # its instance died while it moved (and the move did not save it)
                self.redispatch(request_id, f"instance {orphaned} died")
        with fleet.lock:
            rec = fleet.requests.get(request_id)
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
        self.fleet.instances[dst].incoming[request_id] = self.fleet.blocks_at_full_length(
            len(rec.progress.prompt_token_ids), rec.progress.params.max_new_tokens
        )

    def hand_to_decode(self, request_id: str, src: int) -> None:
        """(control loop) A request has its first token on a prefill instance: move it, KV and all,
        in one stage, to the decode instance with the most room (if none has room, it decodes
        where it is and tries again a little later)."""
        with self.fleet.lock:
            rec = self.fleet.requests.get(request_id)
            if rec is None:
                return
            if rec.owner != src or rec.moving is not None:
                rec.pd_next = time.monotonic() + PD_RETRY_S  # moved or moving meanwhile: looked at again later
                return
            dst = self.router.choose(
                len(rec.progress.prompt_token_ids), rec.progress.params, (Role.DECODE, Role.MIXED), queued=False
            )
            if dst is None or dst == src:
                rec.pd_next = time.monotonic() + PD_RETRY_S
                return
            self._expect(rec, request_id, dst)  # before the migration task starts: the next choice sees it
        self.control.spawn(self.migrate(request_id, src, dst, "pd", max_stages=0))

    def begin_rounds(self) -> None:
        """The first rebalancing round is one --migrate-interval from now."""
        self._last_round = time.monotonic()

    def tick(self) -> None:
        """(control loop, every few tens of ms) Stop the instances that are drained; move requests
        off draining instances; every --migrate-interval, rebalance."""
        draining = any(c.draining and c.alive for c in self.fleet.instances)
        due = self.migrate_interval > 0 and time.monotonic() - self._last_round >= self.migrate_interval
        self._finish_stops()
        if not (draining or due):
            return
        if due:
            self._last_round = time.monotonic()
        self._rebalance(only_drain=not due)

    def _rebalance(self, only_drain: bool) -> None:
        now = time.monotonic()
        # prefill instances hand their requests over by rule (above); the controller balances the rest
        live = [c for c in self.fleet.instances if c.alive and (c.role != Role.PREFILL or c.draining)]
        loads = [c.load() for c in live]
        with self.fleet.lock:
            moving = {r for r, rec in self.fleet.requests.items() if rec.moving is not None}
            cooling = {r for r, rec in self.fleet.requests.items() if now - rec.moved_at < self.cooldown_s}
        candidates = {}
        for c in live:
            s = c.stats
            cands = [MoveCandidate(r, 0, False) for r in s.waiting_ids]
            cands += [MoveCandidate(r, b, True) for r, b in zip(s.running_ids, s.running_blocks)]
            candidates[c.index] = [x for x in cands if x.request_id not in moving]
        draining = {c.index for c in live if c.draining}
        busy = {i for i, n in self.busy.items() if n > 0}
        if only_drain:
            loads = [x for x in loads if x.index in draining or x.accepting]
        for move in plan_moves(loads, candidates, busy, cooling, draining, buddies=self.buddies()):
            if only_drain and move.src not in draining:
                continue
            self.control.spawn(self.migrate(move.request_id, move.src, move.dst, move.reason))

    def _finish_stops(self) -> None:
        """A stopping instance that holds nothing any more is told to stop."""
        for c in self.fleet.instances:
            if c.state != InstanceState.STOPPING or c.stop_sent or not c.alive:
                continue
            with self.fleet.lock:
                held = any(rec.owner == c.index for rec in self.fleet.requests.values())
            s = c.stats
            if held or s.num_requests_running or s.num_requests_waiting or self.busy[c.index] > 0:
                continue
            c.stop_sent = True
            logger.info(f"instance {c.index} is drained; stopping it")
            try:
                c.send(StopInstance())
            except OSError:
                pass

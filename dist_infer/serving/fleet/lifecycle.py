"""Instances joining, reporting, stopping and dying, as the front end sees them: one reader
thread per instance routes its step outputs to the clients' streams; when an instance dies its
requests go on elsewhere from what their clients have (or are quarantined after
--max-request-failovers), and when none is left the server stops."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection

from loguru import logger

from dist_infer.engine.request import RequestOutput
from dist_infer.serving.fleet.instance_record import InstanceClient
from dist_infer.serving.fleet.interface import EngineDeadError, RequestFailedError
from dist_infer.serving.fleet.wire import (
    CallReply,
    Hello,
    InstanceDead,
    InstanceState,
    InstanceStats,
    MigrationEvent,
    PrefixEvents,
    ResumeRequest,
    Role,
    StepOutputs,
)

MAX_AUTO_RESTARTS = 3  # --auto-restart's attempts for an instance that keeps dying before it serves
PD_RETRY_S = 0.5  # a request whose hand-over to a decode instance failed tries again after this
RESTARTABLE = (InstanceState.STARTING, InstanceState.DEAD, InstanceState.STOPPED)  # a driver may join these
LIVING = (InstanceState.SERVING, InstanceState.STOPPING, InstanceState.STARTING)  # the server goes on while one is


class InstanceLifecycle:
    """Cluster's part that follows each instance's life and routes its outputs."""

    def attach(self, conn: Connection, hello: Hello) -> None:
        """A driver connected after start-up: a restarted instance, or a new one (scale-up)."""
        index = hello.index
        problem = None
        if (hello.vocab_size, hello.block_size, hello.max_positions) != \
                (self.vocab_size, self.block_size, self.max_model_len):
            problem = "it serves another model (vocabulary, block size or positions differ)"
        with self._lock:
            if problem is None and isinstance(index, int) and index == len(self.instances):
                self.instances.append(InstanceClient(index))
            if problem is None and not (isinstance(index, int) and 0 <= index < len(self.instances)):
                problem = f"there is no instance {index} (there are {len(self.instances)}; a new one takes the next index)"
            elif problem is None and self.instances[index].state not in RESTARTABLE:
                problem = f"instance {index} is {self.instances[index].state}"
            if problem is None:
                client = self.instances[index]
                client.attach(conn, hello)
                parked = self._unpark()
        if problem is not None:
            logger.error(f"an instance driver wanted to join as instance {index}, refused: {problem}")
            conn.close()
            return
        logger.info(f"instance {index} ({client.spec.describe()}, pids {list(hello.pids)}) joined; it takes requests")
        self._start_reader(client)
        for request_id in parked:
            self._redispatch(request_id, "an instance joined")

    def _unpark(self) -> list[str]:
        """(lock held) The requests waiting for an instance to start; they are dispatched again."""
        parked = [r for r, rec in self._requests.items() if rec.parked]
        for r in parked:
            self._requests[r].parked = False
        return parked

    def _start_reader(self, client: InstanceClient) -> None:
        t = threading.Thread(target=self._read, args=(client, client.conn), name=f"instance-{client.index}-reader",
                             daemon=True)
        t.start()
        self._threads.append(t)

    def _read(self, client: InstanceClient, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (OSError, EOFError):
                if not self._stopping and client.conn is conn:
                    if client.stop_sent:
                        self._instance_stopped(client)
                    else:
                        self._instance_died(client, "its connection closed")
                return
            if client.conn is not conn:
                return  # declared dead from elsewhere (a failed send): its requests went on from their progress
            match message:
                case StepOutputs(outputs=outputs):
                    self._route(client, outputs)
                case InstanceStats():
                    client.stats = message
                case PrefixEvents(stored=stored, removed=removed):
                    client.prefix.apply(stored, removed)
                case CallReply() | MigrationEvent():
                    self._soon(self._on_control, client, message)
                case InstanceDead(reason=reason):
                    if client.conn is conn:
                        self._instance_died(client, reason)
                    return
                case _:
                    logger.warning(f"instance {client.index} sent a message the front end does not know: "
                                   f"{type(message).__name__}")

    def _route(self, client: InstanceClient, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        handover, targets = [], []
        with self._lock:
            for o in outputs:
                rec = self._requests.get(o.request_id)
                # only from where the request runs (or is being taken over): a late copy elsewhere is never streamed
                if rec is None or not (rec.owner == client.index or (rec.moving or (None, None))[1] == client.index):
                    continue
                targets.append((rec.stream, o))
                if o.new_token_ids:  # the autoscaler's window: TTFT, or the gap per token since the last
                    last = rec.progress.last_token
                    self.latency.record(now, ttft=None if last else now - rec.progress.arrival,
                                        gap=now - last if last else None, tokens=len(o.new_token_ids))
                rec.progress.add(o)
                if o.finished and rec.owner == client.index:
                    rec.owner = None
                if o.new_token_ids and rec.recovering is not None:
                    (died_at, dead), rec.recovering = rec.recovering, None
                    self._record_recovery(o.request_id, dead, now - died_at)
                if client.role == Role.PREFILL and not o.finished and o.new_token_ids and rec.owner == client.index \
                        and rec.moving is None and rec.pd_next <= now:
                    rec.pd_next = float("inf")  # until this hand-over is over
                    handover.append(o.request_id)
        for (loop, q), output in targets:
            loop.call_soon_threadsafe(q.put_nowait, output)
        for request_id in handover:
            self._soon(self._hand_to_decode, request_id, client.index)

    def _record_recovery(self, request_id: str, dead: int, seconds: float) -> None:
        self.recovery.observe(seconds)
        self.recoveries.append({"request_id": request_id, "instance": dead, "seconds": seconds})
        logger.info(f"request {request_id} streams again {seconds * 1e3:.0f} ms after instance {dead} died")

    def _instance_stopped(self, client: InstanceClient) -> None:
        client.state, client.conn = InstanceState.STOPPED, None
        logger.info(f"instance {client.index} ({client.spec.describe()}) stopped")
        self._soon(self._fail_calls, client.index)

    def _instance_died(self, client: InstanceClient, reason: str) -> None:
        """An instance failed: its requests go on elsewhere (prefilled again from their tokens so
        far), its migrations are undone, and the other instances serve on. When no instance is
        left (none serving, none starting), the server stops."""
        now = time.monotonic()
        with self._lock:
            if client.state == InstanceState.DEAD:
                return
            client.state, client.dead, client.conn = InstanceState.DEAD, reason, None
            self.failures += 1
            restart = self._restarts_on_death(client)
            if restart:  # counted as starting now: its requests wait for it if no other instance can take them
                client.state = InstanceState.STARTING
            what = f"instance {client.index} ({client.spec.describe()}): {reason}"
            left = [c for c in self.instances if c.state in LIVING]
            orphans, moving, streams = [], set(), []
            if not left:
                self.dead_reason = self.dead_reason or what
                streams = [rec.stream for rec in self._requests.values()]
            else:
                queued = set(client.stats.waiting_ids if client.stats else ())
                for r, rec in self._requests.items():
                    if rec.owner == client.index:
                        orphans.append(r)
                        rec.recovering = (now, client.index)
                        if r not in queued and rec.moving is None:
                            rec.failovers += 1  # it may have been in the step that killed the instance
                        if rec.moving is not None:
                            moving.add(r)
        self._soon(self._fail_calls, client.index)
        if restart:
            threading.Thread(target=self._restart_dead, args=(client, reason), daemon=True,
                             name=f"instance-{client.index}-restart").start()
        if not left:
            logger.error(f"instance {client.index} failed: {reason}; no instance is left")
            error = self._no_instance_left()
            for loop, q in streams:
                loop.call_soon_threadsafe(q.put_nowait, error)
            if self._on_dead is not None:
                self._on_dead(self.dead_reason)
            return
        logger.error(f"instance {client.index} failed ({reason}); its {len(orphans)} request(s) go on on the other "
                     f"instances, prefilled again from their tokens so far")
        for request_id in orphans:
            if request_id not in moving:  # a migrating one is settled when its migration ends
                self._redispatch(request_id, f"instance {client.index} died")

    def _restarts_on_death(self, client: InstanceClient) -> bool:
        """--auto-restart: a dead instance is started again (placed anew by the spawner), up to
        MAX_AUTO_RESTARTS times in a row without serving in between; not while the server stops."""
        return (self.auto_restart and self._spawner is not None and self.accepting
                and client.auto_restarts < MAX_AUTO_RESTARTS)

    def _restart_dead(self, client: InstanceClient, reason: str) -> None:
        """Give the dead job's resources back (its Ray placement group), then start it again."""
        old, client.auto_restarts = client.process, client.auto_restarts + 1
        if old is not None:
            try:
                old.kill()
            except Exception as exc:  # noqa: BLE001 - a job already gone
                logger.debug(f"instance {client.index}: ending its dead job: {exc!r}")
        logger.warning(f"instance {client.index} died ({reason}); --auto-restart starts it again "
                       f"(attempt {client.auto_restarts} of {MAX_AUTO_RESTARTS})")
        try:
            budget = self.rank_budget()
            with self._lock:  # STARTING since it died: its own ranks are left out, the others' counted
                self._claim_ranks(budget, f"layout {client.spec.describe()}", client.spec.size, client)
        except Exception as exc:  # noqa: BLE001 - AdminError: past --max-ranks (the others grew meanwhile)
            self._start_failed(client, client.process, f"--auto-restart did not start it again: {exc}")
            return
        try:
            self._spawn(client, client.spec, "restart")
        except Exception as exc:  # noqa: BLE001 - _spawn marked it dead, logged why and released what waited for it
            logger.error(f"instance {client.index}: the automatic restart failed: {exc}")

    def _no_instance_left(self) -> EngineDeadError:
        """What clients are told: that no instance is left, not why (the why, an instance's error
        text, goes to the log and /admin/instances only)."""
        return EngineDeadError("no model instance is left to serve requests; the server log says why")

    def _redispatch(self, request_id: str, why: str) -> None:
        """Send a request whose instance is gone to another, with what its client already has; fail
        it instead when the instances running it died more than --max-request-failovers times."""
        error = None
        with self._lock:
            rec = self._requests.get(request_id)
            if rec is None:
                return  # its client is gone
            if rec.owner is not None and self.instances[rec.owner].alive:
                rec.recovering = None
                return
            progress, target = rec.progress, rec.stream
            if rec.failovers > self.max_request_failovers:
                rec.owner = rec.recovering = None
                self.requests_quarantined += 1
                error = RequestFailedError(f"request {request_id} failed: {rec.failovers} instances died while running "
                                        f"it (--max-request-failovers {self.max_request_failovers}); it is not "
                                        f"dispatched again")
            else:
                roles = (Role.DECODE, Role.MIXED) if progress.token_ids else (Role.PREFILL, Role.MIXED)
                index = self._choose(len(progress.prompt_token_ids), progress.params, roles, force=True,
                                     hashes=self.prompt_hashes(progress.prompt_token_ids + progress.token_ids,
                                                               progress.params))
                if index is None and any(c.state == InstanceState.STARTING for c in self.instances):
                    rec.parked, rec.owner = True, None  # goes on once an instance has joined
                    logger.warning(f"request {request_id}: no instance takes requests now; it waits for the one starting")
                    return
                rec.owner = index
                if index is None:
                    rec.recovering = None
                    self.requests_lost += 1
                    error = EngineDeadError(f"{why}; no instance could take request {request_id} over")
        if error is not None:
            logger.error(f"request {request_id}: {error}")
            target[0].call_soon_threadsafe(target[1].put_nowait, error)
            return
        logger.info(f"request {request_id} ({len(progress.token_ids)} tokens so far) goes on on instance {index} ({why})")
        try:
            self.instances[index].send(ResumeRequest(request_id, progress.prompt_token_ids, progress.params,
                                                     progress.wire()))
        except OSError:
            self._instance_died(self.instances[index], "its connection failed")
            return
        with self._lock:
            left = request_id not in self._requests
        if left:  # its client went away while it was being sent: an abort sent before the resume did nothing
            self.abort_on(index, request_id)

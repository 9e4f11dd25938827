"""Each instance's life as the front end follows it: a driver joins (or joins again), a reader
thread per instance routes its outputs straight to the clients' streams, and when an instance
stops or dies its requests go on elsewhere from what their clients already have (failover), its
migrations' calls fail, and --auto-restart starts it again. When no instance is left, the server
stops."""

from __future__ import annotations

import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Callable, Optional

from loguru import logger

from dist_infer.engine.request import RequestOutput
from dist_infer.serving.fleet.bucket_counts import BucketCounts
from dist_infer.serving.fleet.config import FleetConfig
from dist_infer.serving.fleet.control_loop import ControlLoop
from dist_infer.serving.fleet.fleet_state import LIVING, FleetState
from dist_infer.serving.fleet.instance_calls import InstanceCalls
from dist_infer.serving.fleet.instance_record import InstanceClient
from dist_infer.serving.fleet.instance_starter import InstanceStarter
from dist_infer.serving.fleet.interface import EngineDeadError, RequestFailedError
from dist_infer.serving.fleet.router import Router
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
from dist_infer.serving.mirror.mirror_control import MirrorControl
from dist_infer.serving.placement.autoscale_policy import LatencyWindow

RESTARTABLE = (InstanceState.STARTING, InstanceState.DEAD, InstanceState.STOPPED)  # a driver may join these
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
Prefilled = Callable[[str, int], None]  # (request id, prefill instance): it has its first token there


def no_instance_left() -> EngineDeadError:
    """What clients are told: that no instance is left, not why (the why, an instance's error
    text, goes to the log and /admin/instances only)."""
    return EngineDeadError("no model instance is left to serve requests; the server log says why")


class Lifecycle:
    def __init__(
        self,
        fleet: FleetState,
        control: ControlLoop,
        calls: InstanceCalls,
        router: Router,
        starter: InstanceStarter,
        config: FleetConfig,
        on_dead: Optional[Callable[[str], None]],
        on_prefilled: Prefilled,
        mirror: MirrorControl,
    ):
        self.fleet, self.control, self.calls, self.router, self.starter = fleet, control, calls, router, starter
        self.max_request_failovers = config.max_request_failovers
        self.on_dead = on_dead  # the server stops: no instance is left
        self.on_prefilled = on_prefilled  # hands the request to a decode instance (on the control loop)
        self.mirror = mirror  # where a request's KV is mirrored (--kv-mirror): its failover goes there
        self.readers: list[threading.Thread] = []
        self.latency = LatencyWindow()  # recent TTFTs and token gaps (the autoscaler's)
        self.recovery = BucketCounts(RECOVERY_BUCKETS)  # from an instance's death to its requests' next token
        self.recoveries: deque[dict] = deque(maxlen=1000)  # {request_id, instance, seconds}
        self.failures = 0  # instances that died
        self.requests_lost = 0  # ended with an error because their instance died and none could take them
        self.requests_quarantined = 0  # failed because the instances running them died too often

    def attach(self, conn: Connection, hello: Hello) -> None:
        """A driver connected after start-up: a restarted instance, or a new one (scale-up)."""
        index, fleet = hello.index, self.fleet
        problem = None
        if (hello.vocab_size, hello.block_size, hello.max_positions) != (
            fleet.vocab_size,
            fleet.block_size,
            fleet.max_model_len,
        ):
            problem = "it serves another model (vocabulary, block size or positions differ)"
        with fleet.lock:
            if problem is None and isinstance(index, int) and index == len(fleet.instances):
                fleet.instances.append(InstanceClient(index, hello=hello))  # attached below
            if problem is None and not (isinstance(index, int) and 0 <= index < len(fleet.instances)):
                problem = (
                    f"there is no instance {index} (there are {len(fleet.instances)}; a new one takes the next index)"
                )
            elif problem is None and fleet.instances[index].state not in RESTARTABLE:
                problem = f"instance {index} is {fleet.instances[index].state}"
            if problem is None:
                client = fleet.instances[index]
                client.attach(conn, hello)
                parked = fleet.unpark()
        if problem is not None:
            logger.error(f"an instance driver wanted to join as instance {index}, refused: {problem}")
            conn.close()
            return
        logger.info(f"instance {index} ({client.spec.describe()}, pids {list(hello.pids)}) joined; it takes requests")
        self.start_reader(client)
        for request_id in parked:
            self.redispatch(request_id, "an instance joined")

    def start_reader(self, client: InstanceClient) -> None:
        t = threading.Thread(
            target=self._read, args=(client, client.conn), name=f"instance-{client.index}-reader", daemon=True
        )
        t.start()
        self.readers.append(t)

    def join_readers(self, deadline: float) -> None:
        for t in list(self.readers):
            t.join(max(0.0, deadline - time.monotonic()))

    def _read(self, client: InstanceClient, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (OSError, EOFError):
                if not self.fleet.stopping and client.conn is conn:
                    if client.stop_sent:
                        self._instance_stopped(client)
                    else:
                        self.instance_died(client, "its connection closed")
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
                    self.control.soon(self.calls.on_message, client, message)
                case InstanceDead(reason=reason):
                    if client.conn is conn:
                        self.instance_died(client, reason)
                    return
                case _:
                    logger.warning(
                        f"instance {client.index} sent a message the front end does not know: {type(message).__name__}"
                    )

    def _route(self, client: InstanceClient, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        handover, targets = [], []
        with self.fleet.lock:
            for o in outputs:
                rec = self.fleet.requests.get(o.request_id)
                # only from where the request runs (or is being taken over): a late copy elsewhere is never streamed
                if rec is None or not (rec.owner == client.index or (rec.moving or (None, None))[1] == client.index):
                    continue
                targets.append((rec.stream, o))
                if o.new_token_ids:  # the autoscaler's window: TTFT, or the gap per token since the last
                    last = rec.progress.last_token
                    self.latency.record(
                        now,
                        ttft=None if last else now - rec.progress.arrival,
                        gap=now - last if last else None,
                        tokens=len(o.new_token_ids),
                    )
                rec.progress.add(o)
                if o.finished and rec.owner == client.index:
                    rec.owner = None
                if o.new_token_ids and rec.recovering is not None:
                    (died_at, dead), rec.recovering = rec.recovering, None
                    self._record_recovery(o.request_id, dead, now - died_at)
                    self.mirror.request_ended(o.request_id)  # it runs on blocks of its own now
                if (
                    client.role == Role.PREFILL
                    and not o.finished
                    and o.new_token_ids
                    and rec.owner == client.index
                    and rec.moving is None
                    and rec.pd_next <= now
                ):
                    rec.pd_next = float("inf")  # until this hand-over is over
                    handover.append(o.request_id)
        for (loop, q), output in targets:
            loop.call_soon_threadsafe(q.put_nowait, output)
        for request_id in handover:
            self.control.soon(self.on_prefilled, request_id, client.index)

    def _record_recovery(self, request_id: str, dead: int, seconds: float) -> None:
        self.recovery.observe(seconds)
        self.recoveries.append({"request_id": request_id, "instance": dead, "seconds": seconds})
        logger.info(f"request {request_id} streams again {seconds * 1e3:.0f} ms after instance {dead} died")

    def _instance_stopped(self, client: InstanceClient) -> None:
        client.state, client.conn = InstanceState.STOPPED, None
        logger.info(f"instance {client.index} ({client.spec.describe()}) stopped")
        self.control.soon(self.calls.fail_calls, client.index)

    def instance_died(self, client: InstanceClient, reason: str) -> None:
        """An instance failed: its requests go on elsewhere (prefilled again from their tokens so
        far), its migrations are undone, and the other instances serve on. When no instance is
        left (none serving, none starting), the server stops."""
        now, fleet = time.monotonic(), self.fleet
        with fleet.lock:
            if client.state == InstanceState.DEAD:
                return
            client.state, client.dead, client.conn = InstanceState.DEAD, reason, None
            self.failures += 1
            restart = self.starter.restarts_on_death(client)
            if restart:  # counted as starting now: its requests wait for it if no other instance can take them
                client.state = InstanceState.STARTING
            what = f"instance {client.index} ({client.spec.describe()}): {reason}"
            left = [c for c in fleet.instances if c.state in LIVING]
            orphans, moving, streams = [], set(), []
            if not left:
                dead_reason = fleet.dead_reason = fleet.dead_reason or what
                streams = [rec.stream for rec in fleet.requests.values()]
            else:
                queued = set(client.stats.waiting_ids)
                for r, rec in fleet.requests.items():
                    if rec.owner == client.index:
                        orphans.append(r)
                        rec.recovering = (now, client.index)
                        if r not in queued and rec.moving is None:
                            rec.failovers += 1  # it may have been in the step that killed the instance
                        if rec.moving is not None:
                            moving.add(r)
        self.control.soon(self.calls.fail_calls, client.index)
        if restart:
            threading.Thread(
                target=self.starter.restart_dead,
                args=(client, reason),
                daemon=True,
                name=f"instance-{client.index}-restart",
            ).start()
        if not left:
            logger.error(f"instance {client.index} failed: {reason}; no instance is left")
            error = no_instance_left()
            for loop, q in streams:
                loop.call_soon_threadsafe(q.put_nowait, error)
            if self.on_dead is not None:
                self.on_dead(dead_reason)
            return
        logger.error(
            f"instance {client.index} failed ({reason}); its {len(orphans)} request(s) go on on the other "
            f"instances, prefilled again from their tokens so far"
        )
        for request_id in orphans:
            if request_id not in moving:  # a migrating one is settled when its migration ends
                self.redispatch(request_id, f"instance {client.index} died")

    def redispatch(self, request_id: str, why: str) -> None:
        """Send a request whose instance is gone to another, with what its client already has; fail
        it instead when the instances running it died more than --max-request-failovers times."""
        fleet = self.fleet
        error: Optional[Exception] = None
        with fleet.lock:
            rec = fleet.requests.get(request_id)
            if rec is None:
                return  # its client is gone
            if rec.owner is not None and fleet.instances[rec.owner].alive:
                rec.recovering = None
                return
            progress, target = rec.progress, rec.stream
            if rec.failovers > self.max_request_failovers:
                rec.owner = rec.recovering = None
                self.requests_quarantined += 1
                error = RequestFailedError(
                    f"request {request_id} failed: {rec.failovers} instances died while running "
                    f"it (--max-request-failovers {self.max_request_failovers}); it is not "
                    f"dispatched again"
                )
            else:
                roles = (Role.DECODE, Role.MIXED) if progress.token_ids else (Role.PREFILL, Role.MIXED)
                index = self.router.choose(
                    len(progress.prompt_token_ids),
                    progress.params,
                    roles,
                    force=True,
                    hashes=self.router.prompt_hashes(progress.prompt_token_ids + progress.token_ids, progress.params),
                    prefer=self.mirror.failover_target(request_id),
                )
                if index is None and fleet.any_starting():
                    rec.parked, rec.owner = True, None  # goes on once an instance has joined
                    logger.warning(
                        f"request {request_id}: no instance takes requests now; it waits for the one starting"
                    )
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
        assert index is not None  # no error: an instance took it over
        logger.info(
            f"request {request_id} ({len(progress.token_ids)} tokens so far) goes on on instance {index} ({why})"
        )
        try:
            fleet.instances[index].send(
                ResumeRequest(request_id, progress.prompt_token_ids, progress.params, progress.wire())
            )
        except OSError:
            self.instance_died(fleet.instances[index], "its connection failed")
            return
        with fleet.lock:
            left = request_id not in fleet.requests
        if left:  # its client went away while it was being sent: an abort sent before the resume did nothing
            fleet.abort_on(index, request_id)

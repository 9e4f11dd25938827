"""An instance's driver: its step loop, fed over one connection by the front end.

The front end (serving/fleet/cluster.py) owns the clients' streams and decides which instance runs
each request; every instance's driver (its first rank) connects to it and then only does what
it is told: add and abort requests, and the calls of a migration (engine/migration.py). After
every step it sends the step's outputs and its load back. The messages are serving/fleet/wire.py's
dataclasses over multiprocessing's authenticated connection (pickled over TCP), so instances on
other hosts work the same.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection
from typing import Optional

from loguru import logger

from dist_infer.engine.migration import MigrationAborted, MigrationOutcome
from dist_infer.engine.request import RequestError, RequestOutput
from dist_infer.serving.fleet.wire import (
    AbortRequest,
    AddRequest,
    CallReply,
    Hello,
    InstanceDead,
    InstanceStats,
    MigrationCall,
    MigrationEvent,
    MigrationEventKind,
    MigrationOp,
    PrefixEvents,
    ResumeRequest,
    StepOutputs,
    StopInstance,
)
from dist_infer.serving.instance.migration_calls import run_migration_op

STATS_EVERY_S = 0.1  # an instance's load reaches the API at least this often while it changes


class InstanceServer:
    def __init__(self, engine, index: int, conn: Connection):
        self.engine, self.index, self.conn = engine, index, conn
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._last_stats: Optional[InstanceStats] = None
        self._last_stats_at = 0.0
        self._block_bytes = 0  # the KV bytes of one block over all the instance's ranks (its hello says)

    def send(self, message: object) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError, BrokenPipeError) as exc:
                if not self._stop.is_set():
                    logger.error(f"instance {self.index}: the front end is gone ({exc}); stopping")
                self._stop.set()
                self.engine.wake()

    # -- the API's messages (a reader thread) ----------------------------------------------------
    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                message = self.conn.recv()
            except (OSError, EOFError):
                if not self._stop.is_set():
                    logger.error(f"instance {self.index}: lost the connection to the front end; stopping")
                break
            match message:
                case AddRequest() | ResumeRequest():
                    self._add(message)
                case AbortRequest(request_id=request_id):
                    self.engine.abort(request_id)
                case MigrationCall(call_id=call_id, op=op):
                    self._call(call_id, op)
                case StopInstance():
                    break
                case _:
                    logger.warning(f"instance {self.index}: ignored an unknown message {type(message).__name__}")
        self._stop.set()
        self.engine.wake()

    def _add(self, message: AddRequest | ResumeRequest) -> None:
        request_id = message.request_id
        try:
            if isinstance(message, ResumeRequest):
                self._resume(message)
            else:
                self.engine.add_request(request_id, message.prompt_token_ids, message.params)
        except RequestError as exc:
            self.engine.call_soon(self.engine.count_rejected)  # the API counts it as seen, not as queued here
            self.send(
                StepOutputs(
                    [RequestOutput(request_id, [], [], [], "", True, "abort", error=str(exc), error_status=400)]
                )
            )

    def _resume(self, message: ResumeRequest) -> None:
        """A request whose instance died goes on here: from its KV mirror's partial block if this
        instance holds one (engine/mirror/store.py), else queued (its mirrored full blocks, if any,
        are prefix-cache hits)."""
        engine, endpoint = self.engine, self.engine.migration
        r = engine.resume_request(
            message.request_id, message.prompt_token_ids, message.params, message.progress, submit=endpoint is None
        )
        if endpoint is not None:
            engine.call_soon(lambda: endpoint.mirror_in.take_over(r) or engine.registry.submit(r))

    def _call(self, call_id: int, op: MigrationOp) -> None:
        def reply(value: object) -> None:
            if isinstance(value, MigrationAborted):
                self.send(CallReply(call_id, False, (value.outcome, str(value))))
            elif isinstance(value, BaseException):
                self.send(CallReply(call_id, False, (MigrationOutcome.ERROR, f"{type(value).__name__}: {value}")))
            else:
                self.send(CallReply(call_id, True, value))

        if not isinstance(op, MigrationOp) or self.engine.migration is None:
            what = op.name if isinstance(op, MigrationOp) else type(op).__name__
            return reply(
                ValueError(
                    f"instance {self.index} takes no call {what!r} (a context-parallel instance does not migrate)"
                )
            )
        endpoint = self.engine.migration

        def run() -> None:
            try:
                run_migration_op(endpoint, op, reply)
            except Exception as exc:  # noqa: BLE001 - the caller gets it, the step loop goes on
                reply(exc)

        self.engine.call_soon(run)

    # -- the step loop (this thread) ---------------------------------------------------------------
    def _notify(self, event: str, migration_id: int, stage: int) -> None:
        """engine/migration.py's report of a stage, typed for the wire (ValueError for an event it does not name)."""
        self.send(MigrationEvent(MigrationEventKind(event), migration_id, stage))

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.send(StepOutputs(outputs))

    def _after_step(self) -> None:
        """Send the load when it changed: at once if the batch or the queue did (or the instance is
        idle), else at most every STATS_EVERY_S (the API's dispatcher and migration controller read it)."""
        stored, removed = self.engine.prefix_events()
        if stored or removed:  # every step that changed the cache: the front end's index must not miss one
            self.send(PrefixEvents(tuple(stored), tuple(removed)))
        stats = InstanceStats.from_dict(dict(self.engine.stats(), kv_mirror=self._mirror_stats()))
        if stats == self._last_stats:
            return
        key = lambda s: (s.num_requests_running, s.num_requests_waiting, s.requests_added)  # noqa: E731
        now = time.monotonic()
        idle = not stats.num_requests_running and not stats.num_requests_waiting
        if (
            self._last_stats is None
            or key(stats) != key(self._last_stats)
            or idle
            or now - self._last_stats_at >= STATS_EVERY_S
        ):
            self.send(stats)
            self._last_stats, self._last_stats_at = stats, now

    def _mirror_stats(self) -> Optional[dict]:
        """KV mirroring's counters, both sides (engine/mirror/), and what the step loop spent on it."""
        endpoint = self.engine.migration
        if endpoint is None:
            return None
        out = endpoint.mirror_out
        snapshot = out.snapshot()
        return {
            **snapshot,
            "bytes_sent": snapshot["blocks_sent"] * self._block_bytes,
            **endpoint.mirror_in.snapshot(),
            "step_wait_seconds": out.step_wait_s + self.engine.mover.send_wait_s,
            "failover_recomputed_tokens": self.engine.scheduler.failover_recomputed_tokens,
        }

    def run(self, hello: Hello) -> None:
        """Serve until the API says stop or goes away; raises (after telling the API) if the engine fails."""
        if self.engine.migration is not None:
            self.engine.migration.notify = self._notify
        self._block_bytes = hello.block_bytes
        self.engine.grammars.warm()  # structured outputs' vocabulary, built beside the first requests' wait
        self.send(hello)
        reader = threading.Thread(target=self._read, name=f"instance-{self.index}-commands", daemon=True)
        reader.start()
        try:
            self.engine.run_driver(self._publish, self._stop.is_set, self._after_step)
        except BaseException as exc:
            self.send(InstanceDead(f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            self._stop.set()
            try:
                self.conn.close()
            except OSError:
                pass

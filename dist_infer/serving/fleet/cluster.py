"""The front end's view of the model instances: dispatch, streams, and live migration.

It is what the HTTP server talks to (the EngineClient interface, serving/fleet/interface.py), for
one instance or many. Each instance's driver is connected over one authenticated connection
(serving/instance/driver_loop.py); a reader thread per instance routes step outputs straight to
the client streams, and a control thread runs an asyncio loop for everything that waits on
instances: migration calls (serving/migration/live_migration.py) and the migration controller
(serving/migration/rebalance_policy.py). The front end owns every client's stream, so a request that moves
keeps streaming to its client without a break: its outputs simply start coming from another
instance.

Cluster is the composition root: each part is an object of its own, given what it uses when it is
made, and Cluster itself holds the clients' streams (generate, abort) and delegates the rest.

    FleetState        the instances, the request records, the lock, the server's flags (fleet_state.py)
    ControlLoop       the control thread's asyncio loop (control_loop.py)
    InstanceCalls     the migration calls on the drivers and their stage reports (instance_calls.py)
    Router            where a request goes (router.py, over dispatch.py's policies)
    InstanceStarter   starting instances as jobs, bounded by --max-ranks (instance_starter.py)
    Lifecycle         readers, deaths, failover, --auto-restart (lifecycle.py)
    MigrationControl  migrations, the prefill/decode hand-over, the controller's rounds (migration/control.py)
    MirrorControl     KV mirroring to buddies, and failover onto the mirrors (mirror/mirror_control.py)
    AdminOps          the /admin operations (admin_ops.py)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import AsyncIterator, Callable, Optional

from loguru import logger

from dist_infer.engine.request import RequestError, RequestOutput, check_prompt
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import check_fits
from dist_infer.serving.fleet.admin_ops import AdminOps
from dist_infer.serving.fleet.config import FleetConfig
from dist_infer.serving.fleet.control_loop import ControlLoop
from dist_infer.serving.fleet.dispatch import Dispatcher
from dist_infer.serving.fleet.fleet_state import FleetState
from dist_infer.serving.fleet.instance_calls import InstanceCalls
from dist_infer.serving.fleet.instance_record import InstanceClient, Progress, RequestRecord
from dist_infer.serving.fleet.instance_starter import InstanceStarter, Spawner
from dist_infer.serving.fleet.interface import AdminError, QueueFullError, RequestFailedError
from dist_infer.serving.fleet.lifecycle import Lifecycle, no_instance_left
from dist_infer.serving.fleet.router import Router
from dist_infer.serving.fleet.wire import AbortRequest, AddRequest, Hello, StopInstance
from dist_infer.serving.migration.control import MigrationControl
from dist_infer.serving.mirror.mirror_control import MirrorControl
from dist_infer.serving.placement.rank_budget import RankBudget

TICK_S = 0.05  # how often the control loop looks at the autoscaler, draining and stopping instances
__all__ = ["AdminError", "Cluster", "FleetConfig", "InstanceClient", "Progress", "RequestRecord"]


class Cluster:
    """The EngineClient over one or more instances (serving/fleet/interface.py), and the admin
    operations of serving/http/admin_routes.py and serving/placement/autoscaler.py."""

    def __init__(
        self,
        clients: list[InstanceClient],
        model_name: str,
        tokenizer=None,
        chat_template: Optional[str] = None,
        config: FleetConfig = FleetConfig(),
        *,
        on_dead: Optional[Callable[[str], None]] = None,
        spawner: Optional[Spawner] = None,
        rank_capacity: Optional[Callable[[], RankBudget]] = None,
    ):
        self.model_name, self.tokenizer, self.chat_template = model_name, tokenizer, chat_template
        self.config = config
        self.fleet = FleetState(clients)
        self.control = ControlLoop()
        self.calls = InstanceCalls(self.fleet, self.control)
        self.router = Router(self.fleet, Dispatcher(config.dispatch))
        self.starter = InstanceStarter(self.fleet, config, spawner, rank_capacity, self._redispatch)
        self.mirror = MirrorControl(self.fleet, self.control, self.calls, config)
        self.migration = MigrationControl(
            self.fleet,
            self.control,
            self.calls,
            self.router,
            config,
            self._redispatch,
            self.mirror.request_ended,
            lambda: self.mirror.pairs,
        )
        self.lifecycle = Lifecycle(
            self.fleet,
            self.control,
            self.calls,
            self.router,
            self.starter,
            config,
            on_dead,
            self.migration.hand_to_decode,
            self.mirror,
        )
        self.admin = AdminOps(self.fleet, self.control, self.starter, self.migration, config)
        self.autoscaler = None  # serving/placement/autoscaler.py, when --autoscale is given

    def _redispatch(self, request_id: str, why: str) -> None:
        """What the starter and the migrations are given to fail a request over: the lifecycle
        does it, and the lifecycle is made after them (it starts instances and hands requests to
        decode through them)."""
        self.lifecycle.redispatch(request_id, why)

    # -- what the HTTP side reads (EngineClient) -----------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.fleet.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.fleet.vocab_size

    @property
    def dead_reason(self) -> Optional[str]:
        return self.fleet.dead_reason

    @property
    def instances(self) -> list[InstanceClient]:
        return self.fleet.instances

    @property
    def latency(self):
        """Recent TTFTs and token gaps (the autoscaler's window)."""
        return self.lifecycle.latency

    @property
    def requests_quarantined(self) -> int:
        return self.lifecycle.requests_quarantined

    # -- start and stop ------------------------------------------------------------------------------
    def start(self) -> None:
        self.control.start(self._control)
        for client in self.fleet.instances:
            self.lifecycle.start_reader(client)

    async def _control(self) -> None:
        """The control loop's rounds until stop(): the autoscaler, then the migration controller."""
        self.migration.begin_rounds()
        while not self.fleet.stopping:
            await asyncio.sleep(TICK_S)
            if self.fleet.dead_reason is not None:
                continue
            try:
                if self.autoscaler is not None:
                    self.autoscaler.tick()
                self.migration.tick()
                self.mirror.tick()
            except Exception as exc:  # noqa: BLE001 - a bad round must not end the control loop
                logger.exception(f"migration controller: {exc}")

    def attach(self, conn: Connection, hello: Hello) -> None:
        """A driver connected after start-up: a restarted instance, or a new one (scale-up)."""
        self.lifecycle.attach(conn, hello)

    def stop(self, timeout: float = 60.0) -> None:
        """Tell every instance to stop (each tells its ranks), wait for the jobs this process
        started, and end the control loop."""
        self.fleet.accepting = False
        self.fleet.stopping = True
        for client in self.fleet.instances:
            if client.alive:
                try:
                    client.send(StopInstance())
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        self.lifecycle.join_readers(deadline)
        for client in self.fleet.instances:
            if client.process is not None:
                try:
                    client.process.wait(max(1.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - a job that will not stop is ended
                    client.process.kill()
        self.control.join(max(1.0, deadline - time.monotonic()))  # the control loop sees `stopping`

    def begin_shutdown(self) -> None:
        self.fleet.accepting = False

    # -- what the fleet holds and has done ---------------------------------------------------------
    def stats(self) -> dict:
        instances, lifecycle, migration = self.fleet.instances, self.lifecycle, self.migration
        live = [c for c in instances if c.alive] or [c for c in instances if c.hello is not None][:1]
        per = [dict(c.stats.as_dict(), engine=str(c.index)) for c in live]
        free, total = sum(s["free_blocks"] for s in per), sum(s["total_blocks"] for s in per)
        return {
            "num_requests_running": sum(s["num_requests_running"] for s in per),
            "num_requests_waiting": sum(s["num_requests_waiting"] for s in per),
            "kv_cache_usage_perc": 1.0 - free / total if total else 0.0,
            "num_preemptions_total": sum(s["num_preemptions_total"] for s in per),
            "free_blocks": free,
            "total_blocks": total,
            "instances": per,
            "migrations_total": dict(migration.outcomes),
            "migration_downtime": migration.downtime.snapshot(),
            "requests_recovered": lifecycle.recovery.snapshot(),
            "requests_lost_total": lifecycle.requests_lost,
            "instance_failures_total": lifecycle.failures,
            "requests_quarantined_total": lifecycle.requests_quarantined,
            "kv_mirror": self.mirror.snapshot(),
            "frontend_entries": self.held(),
            **({"autoscale_decisions_total": dict(self.autoscaler.counts)} if self.autoscaler else {}),
        }

    def held(self) -> dict[str, int]:
        """Entries the front end holds that belong to requests or migrations: all 0 when idle
        (dist_infer:frontend_entries; the tests check nothing outlives its request)."""
        with self.fleet.lock:
            requests = len(self.fleet.requests)
            calls = self.calls.held()
            return {
                "requests": requests,
                "calls": calls["calls"],
                "events": calls["events"],
                "migrations": calls["migrations"],
                "busy": sum(self.migration.busy.values()),
                "incoming": sum(len(c.incoming) for c in self.fleet.instances),
            }

    def num_open(self) -> int:
        """Requests the front end holds: streaming, queued or moving."""
        with self.fleet.lock:
            return len(self.fleet.requests)

    def first_token_waits(self, now: float) -> list[float]:
        """How long each request without its first token yet has waited (the autoscaler's queue signal)."""
        with self.fleet.lock:
            return [
                now - rec.progress.arrival for rec in self.fleet.requests.values() if rec.progress.first_token is None
            ]

    # -- the admin operations (serving/http/admin_routes.py, the autoscaler) -------------------------
    def describe_instances(self) -> list[dict]:
        """/admin/instances: each instance, with its KV mirror buddy and mirroring counters (--kv-mirror)."""
        out = self.admin.describe_instances()
        for d in out:
            d["kv_mirror_buddy"] = self.mirror.pairs.get(d["index"])
            d["kv_mirror"] = self.fleet.instances[d["index"]].stats.kv_mirror
        return out

    def migrate_now(self, request_id: str, to_instance: int, mode: str = "live") -> concurrent.futures.Future:
        return self.admin.migrate_now(request_id, to_instance, mode)

    def drain(self, index: int) -> dict:
        return self.admin.drain(index)

    def stop_instance(self, index: int) -> dict:
        return self.admin.stop_instance(index)

    def restart_instance(self, index: int) -> dict:
        return self.admin.restart_instance(index)

    def add_instance(self, layout: str) -> dict:
        return self.admin.add_instance(layout)

    def describe_ranks(self) -> dict:
        return self.starter.describe_ranks()

    def ranks_held(self) -> int:
        return self.starter.ranks_held()

    def ranks_free(self) -> Optional[int]:
        return self.starter.ranks_free()

    # -- requests --------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_token_ids, params, self.fleet.vocab_size, self.fleet.max_model_len)
        known = [c for c in self.fleet.instances if c.hello is not None]
        largest = max(known, key=lambda c: c.total_blocks)
        why = check_fits(
            len(prompt_token_ids), params.max_new_tokens, largest.total_blocks, self.fleet.block_size, self.fleet.cp
        )
        if why:
            raise RequestError("max_tokens", f"prompt: {why}")

    def abort(self, request_id: str) -> None:
        fleet = self.fleet
        with fleet.lock:
            rec = fleet.requests.get(request_id)
            index = rec.owner if rec is not None else None
            if rec is not None:
                rec.aborted, rec.parked = rec.moving is not None, False
        if index is not None and fleet.instances[index].alive:
            try:
                fleet.instances[index].send(AbortRequest(request_id))
            except OSError:
                pass

    def _admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """The request's record and the queue its outputs stream through; QueueFullError (or no
        instance left) if it cannot be taken now."""
        fleet = self.fleet
        if fleet.dead_reason is not None:
            raise no_instance_left()
        if not fleet.accepting:
            raise QueueFullError(retry_after_s=5.0)
        if fleet.num_queued() >= self.config.max_queue:
            raise QueueFullError(retry_after_s=1.0)
        q: asyncio.Queue = asyncio.Queue()
        with fleet.lock:
            if fleet.dead_reason is not None:
                raise no_instance_left()
            if request_id in fleet.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            fleet.requests[request_id] = RequestRecord(
                Progress(list(prompt_token_ids), params), (asyncio.get_running_loop(), q)
            )
        return q

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if params.seed is None and not params.greedy:
            # drawn here, not by the instance, so a request resumed elsewhere samples what it would have
            params = replace(params, seed=secrets.randbits(52))
        q = self._admit(request_id, prompt_token_ids, params)
        finished = False
        try:
            client = self.router.dispatch(request_id, prompt_token_ids, params)
            try:
                client.send(AddRequest(request_id, list(prompt_token_ids), params))
            except OSError:
                self.lifecycle.instance_died(client, "its connection failed")
            while not finished:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    finished = True
                    if item.error_status == 400:
                        raise RequestError("prompt", item.error)
                    raise RequestFailedError(item.error)
                finished = item.finished
                yield item
        finally:
            with self.fleet.lock:
                rec = self.fleet.requests.pop(request_id, None)  # the one place a request's record is removed
            self.mirror.request_ended(request_id)
            if not finished and rec is not None and rec.owner is not None:
                # the client went away, or an error: free its blocks. The record goes first, so a
                # redispatch racing this sees no record and aborts the copy it sent (see Lifecycle.redispatch)
                self.fleet.abort_on(rec.owner, request_id)

"""The API process's view of the model instances: dispatch, streams, and live migration.

It is what the HTTP server talks to (the EngineClient interface, serving/http/api_server.py), for
one instance or many. Each instance's driver is connected over one authenticated connection
(serving/instance/driver_loop.py); a reader thread per instance routes step outputs straight to
the client streams, and a control thread runs an asyncio loop for everything that waits on
instances: migration calls (serving/migration/live_migration.py) and the migration controller
(serving/migration/rebalance_policy.py). The API process owns every client's stream, so a request that moves
keeps streaming to its client without a break: its outputs simply start coming from another
instance.

Cluster is this module's dispatch and streams plus four parts, each a module of its own over the
same state: the calls to instances' drivers (instance_rpc.py), instances' lives and outputs
(instance_lifecycle.py), the admin operations (instance_admin.py) and moving requests
(controller.py). What it holds per instance and per request is in instance_client.py.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from collections import Counter, deque
from dataclasses import replace
from typing import AsyncIterator, Callable, Optional

from dist_infer.engine.request import RequestError, RequestOutput, check_prompt
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import blocks_at_full_length, check_fits
from dist_infer.serving.fleet.admin_ops import InstanceAdmin
from dist_infer.serving.fleet.bucket_counts import BucketCounts
from dist_infer.serving.fleet.dispatch import Dispatcher
from dist_infer.serving.fleet.instance_calls import InstanceCalls
from dist_infer.serving.fleet.instance_record import InstanceClient, Progress, RequestRecord
from dist_infer.serving.fleet.instance_specs import InstanceSpec
from dist_infer.serving.fleet.interface import AdminError, QueueFullError, RequestFailedError
from dist_infer.serving.fleet.lifecycle import InstanceLifecycle
from dist_infer.serving.fleet.prefix_index import prompt_block_hashes
from dist_infer.serving.fleet.wire import AbortRequest, AddRequest, Role, StopInstance
from dist_infer.serving.migration.control import MigrationControl
from dist_infer.serving.migration.live_migration import MigrationResult
from dist_infer.serving.placement.autoscale_policy import LatencyWindow
from dist_infer.serving.placement.rank_budget import RankBudget

Spawner = Callable[[int, InstanceSpec], object]  # starts instance i as a job of its own; returns its process
DOWNTIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
__all__ = ["AdminError", "Cluster", "InstanceClient", "Progress", "RequestRecord"]


class Cluster(InstanceCalls, InstanceLifecycle, InstanceAdmin, MigrationControl):
    """The EngineClient over one or more instances (see serving/http/api_server.py for the interface)."""

    def __init__(self, clients: list[InstanceClient], model_name: str, tokenizer=None,
                 chat_template: Optional[str] = None, max_queue: int = 1024, dispatch: str = "prefix",
                 migrate_interval: float = 1.0, migration_timeout: float = 30.0, cooldown_s: Optional[float] = None,
                 on_dead: Optional[Callable[[str], None]] = None, spawner: Optional[Spawner] = None,
                 join_timeout_s: float = 300.0, max_request_failovers: int = 1, max_instances: int = 16,
                 auto_restart: bool = False, rank_capacity: Optional[Callable[[], RankBudget]] = None):
        first = clients[0].hello
        self.instances = clients
        self.model_name, self.tokenizer, self.chat_template = model_name, tokenizer, chat_template
        self.max_model_len, self.vocab_size = first.max_positions, first.vocab_size
        self.block_size, self.block_bytes = first.block_size, first.block_bytes
        self.cp = first.cp
        self.max_queue = max_queue
        self.dispatcher = Dispatcher(dispatch)
        self.migrate_interval, self.migration_timeout = migrate_interval, migration_timeout
        self.cooldown_s = cooldown_s if cooldown_s is not None else max(2.0, 5 * migrate_interval)
        self.dead_reason: Optional[str] = None
        self.accepting = True
        self._on_dead = on_dead
        self._spawner = spawner
        self.join_timeout_s = join_timeout_s
        self.max_request_failovers, self.max_instances = max_request_failovers, max_instances
        self.auto_restart = auto_restart  # a dead instance is started again (placed anew by the spawner)
        self._rank_capacity = rank_capacity  # -> the rank budget every start must fit (None: unbounded)
        self.latency = LatencyWindow()  # recent TTFTs and token gaps (the autoscaler's)
        self.autoscaler = None  # serving/placement/autoscaler.py, when --autoscale is given
        self._lock = threading.RLock()
        self._requests: dict[str, RequestRecord] = {}
        self._busy: Counter = Counter()  # instance -> migrations it takes part in
        self._active_migrations: set[int] = set()  # their ids: random, so no one can guess the next one's KV keys
        self._ids = itertools.count(1)  # call ids (each answered on its own instance's connection)
        self._calls: dict[int, tuple[asyncio.Future, int]] = {}
        self._events: dict[tuple, asyncio.Future] = {}
        self.outcomes: Counter = Counter()
        self.downtime = BucketCounts(DOWNTIME_BUCKETS)  # of live migrations that succeeded (seconds)
        self.recovery = BucketCounts(RECOVERY_BUCKETS)  # from an instance's death to its requests' next token
        self.recoveries: deque[dict] = deque(maxlen=1000)  # {request_id, instance, seconds}
        self.failures = 0  # instances that died
        self.requests_lost = 0  # ended with an error because their instance died and none could take them
        self.requests_quarantined = 0  # failed because the instances running them died too often
        self.history: deque[MigrationResult] = deque(maxlen=1000)
        self._stopping = False
        self.loop = asyncio.new_event_loop()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        control = threading.Thread(target=self._run_loop, name="cluster-control", daemon=True)
        control.start()
        self._threads.append(control)
        for client in self.instances:
            self._start_reader(client)

    def _run_loop(self) -> None:
        """The control loop runs until stop(); then what is still pending (migrations) is cancelled."""
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._controller())
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    def _soon(self, fn, *args) -> None:
        """Run fn(*args) on the control loop; nothing once the loop has closed (the server stops)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def stop(self, timeout: float = 60.0) -> None:
        """Tell every instance to stop (each tells its ranks), wait for the jobs this process
        started, and end the control loop."""
        self.accepting = False
        self._stopping = True
        for client in self.instances:
            if client.alive:
                try:
                    client.send(StopInstance())
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for t in self._threads[1:]:
            t.join(max(0.0, deadline - time.monotonic()))
        for client in self.instances:
            if client.process is not None:
                try:
                    client.process.wait(max(1.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - a job that will not stop is ended
                    client.process.kill()
        self._threads[0].join(max(1.0, deadline - time.monotonic()))  # the controller sees _stopping

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        known = [c for c in self.instances if c.hello is not None]
        largest = max(known, key=lambda c: c.total_blocks)
        why = check_fits(len(prompt_token_ids), params.max_new_tokens, largest.total_blocks, self.block_size,
                         self.cp)
        if why:
            raise RequestError("max_tokens", f"prompt: {why}")

    def begin_shutdown(self) -> None:
        self.accepting = False

    def abort(self, request_id: str) -> None:
        with self._lock:
            rec = self._requests.get(request_id)
            index = rec.owner if rec is not None else None
            if rec is not None:
                rec.aborted, rec.parked = rec.moving is not None, False
        if index is not None and self.instances[index].alive:
            try:
                self.instances[index].send(AbortRequest(request_id))
            except OSError:
                pass

    def stats(self) -> dict:
        live = [c for c in self.instances if c.alive] or [c for c in self.instances if c.stats][:1]
        per = [dict(c.stats.as_dict(), engine=str(c.index)) for c in live]
        free, total = sum(s["free_blocks"] for s in per), sum(s["total_blocks"] for s in per)
        return {"num_requests_running": sum(s["num_requests_running"] for s in per),
                "num_requests_waiting": sum(s["num_requests_waiting"] for s in per),
                "kv_cache_usage_perc": 1.0 - free / total if total else 0.0,
                "num_preemptions_total": sum(s["num_preemptions_total"] for s in per),
                "free_blocks": free, "total_blocks": total, "instances": per,
                "migrations_total": dict(self.outcomes),
                "migration_downtime": self.downtime.snapshot(), "requests_recovered": self.recovery.snapshot(),
                "requests_lost_total": self.requests_lost, "instance_failures_total": self.failures,
                "requests_quarantined_total": self.requests_quarantined, "frontend_entries": self.held(),
                **({"autoscale_decisions_total": dict(self.autoscaler.counts)} if self.autoscaler else {})}

    def num_open(self) -> int:
        """Requests the front end holds: streaming, queued or moving."""
        with self._lock:
            return len(self._requests)

    def first_token_waits(self, now: float) -> list[float]:
        """How long each request without its first token yet has waited (the autoscaler's queue signal)."""
        with self._lock:
            return [now - rec.progress.arrival for rec in self._requests.values() if rec.progress.first_token is None]

    def _num_queued(self) -> int:
        with self._lock:
            open_streams = len(self._requests)
        running = sum(c.stats.num_requests_running for c in self.instances if c.alive)
        return max(0, open_streams - running)

    def _choose(self, prompt_len: int, params: SamplingParams, roles: tuple[str, ...],
                force: bool = False, queued: bool = True, hashes: tuple[int, ...] = ()) -> Optional[int]:
        """The instance for a request (with the lock held): among those accepting, the ones of the
        roles asked for (any, if none of them accepts); `force`: if none has room, still the least
        loaded (it queues there). `queued`: it arrives as an add the instance will count. `hashes`:
        the block hashes of what it will compute there (prompt_hashes), which the `prefix` policy
        looks up in each instance's prefix cache."""
        need = blocks_at_full_length(prompt_len, params.max_new_tokens, self.block_size, self.cp)
        accepting = [c for c in self.instances if c.accepting]
        pool = [c for c in accepting if c.role in roles] or accepting
        loads = [c.load(hashes) for c in pool]
        index = self.dispatcher.choose(loads, need, len(hashes))
        if index is None and force and loads:
            index = max(loads, key=lambda x: (x.freeness, -x.index)).index
        if index is not None and queued:
            client = self.instances[index]
            with client._pending_lock:
                client.sent += 1
                client.pending.append((client.sent, need))
            client.prefix.expect(hashes)
        return index

    def prompt_hashes(self, tokens: list[int], params: SamplingParams) -> tuple[int, ...]:
        """The block hashes the `prefix` dispatch looks up, salted with the request's cache salt as
        the instance salts them (none for the other policies); computed before the lock is taken (a
        long prompt hashes for a while)."""
        if self.dispatcher.policy != "prefix":
            return ()
        return tuple(prompt_block_hashes(tokens, self.block_size, params.cache_salt))

    def _dispatch(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> InstanceClient:
        hashes = self.prompt_hashes(prompt_token_ids, params)
        with self._lock:
            index = self._choose(len(prompt_token_ids), params, (Role.PREFILL, Role.MIXED), hashes=hashes)
            if index is None:
                raise QueueFullError(retry_after_s=5.0)
            self._requests[request_id].owner = index
        return self.instances[index]

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None:
            raise self._no_instance_left()
        if not self.accepting:
            raise QueueFullError(retry_after_s=5.0)
        if self._num_queued() >= self.max_queue:
            raise QueueFullError(retry_after_s=1.0)
        if params.seed is None and not params.greedy:
            # drawn here, not by the instance, so a request resumed elsewhere samples what it would have
            params = replace(params, seed=secrets.randbits(52))
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.dead_reason is not None:
                raise self._no_instance_left()
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._requests[request_id] = RequestRecord(Progress(list(prompt_token_ids), params),
                                                       (asyncio.get_running_loop(), q))
        finished = False
        try:
            client = self._dispatch(request_id, prompt_token_ids, params)
            try:
                client.send(AddRequest(request_id, list(prompt_token_ids), params))
            except OSError:
                self._instance_died(client, "its connection failed")
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
            with self._lock:
                rec = self._requests.pop(request_id, None)  # the one place a request's record is removed
            if not finished and rec is not None and rec.owner is not None:
                # the client went away, or an error: free its blocks. The record goes first, so a
                # redispatch racing this sees no record and aborts the copy it sent (see _redispatch)
                self.abort_on(rec.owner, request_id)

    def held(self) -> dict[str, int]:
        """Entries the front end holds that belong to requests or migrations: all 0 when idle
        (dist_infer:frontend_entries; the tests check nothing outlives its request)."""
        with self._lock:
            out = {"requests": len(self._requests), "calls": len(self._calls), "events": len(self._events),
                   "migrations": len(self._active_migrations), "busy": sum(self._busy.values()),
                   "incoming": sum(len(c.incoming) for c in self.instances)}
        return out

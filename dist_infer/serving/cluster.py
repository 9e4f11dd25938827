"""The API process's view of the model instances: dispatch, streams, and live migration.

It is what the HTTP server talks to (the EngineClient interface, serving/api_server.py), for
one instance or many. Each instance's driver is connected over one authenticated connection
(serving/instance_server.py); a reader thread per instance routes step outputs straight to
the client streams, and a control thread runs an asyncio loop for everything that waits on
instances: migration calls (serving/migration.py) and the migration controller
(serving/rebalance.py). The API process owns every client's stream, so a request that moves
keeps streaming to its client without a break: its outputs simply start coming from another
instance.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections import Counter, deque
from multiprocessing.connection import Connection
from typing import AsyncIterator, Callable, Optional

from loguru import logger

from dist_infer.engine.migration import MigrationAborted
from dist_infer.engine.request import RequestError, RequestOutput, check_prompt
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import blocks_at_full_length, check_fits
from dist_infer.serving.dispatch import Dispatcher, InstanceLoad
from dist_infer.serving.errors import EngineDeadError, QueueFullError
from dist_infer.serving.migration import MODES, MigrationResult, migrate
from dist_infer.serving.rebalance import MoveCandidate, plan_moves

DOWNTIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TICK_S = 0.05  # how often the controller looks at draining instances


class AdminError(ValueError):
    """An admin request that cannot be done; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class InstanceClient:
    """One instance as the API process sees it: its connection, its last reported load, and the
    requests sent to it that it has not reported yet."""

    def __init__(self, index: int, conn: Connection, hello: dict):
        self.index, self.conn, self.hello = index, conn, hello
        self.stats: dict = {"free_blocks": hello["total_blocks"], "total_blocks": hello["total_blocks"],
                            "num_requests_running": 0, "num_requests_waiting": 0, "requests_added": 0,
                            "running_ids": [], "waiting_ids": [], "running_blocks": [], "num_preemptions_total": 0,
                            "kv_cache_usage_perc": 0.0, "watermark_blocks": 0, "waiting_demand_blocks": 0}
        self.sent = 0  # add messages sent
        self.pending: deque[tuple[int, int]] = deque()  # (add number, blocks its prompt needs)
        self.draining = False
        self.dead: Optional[str] = None
        self._lock = threading.Lock()

    @property
    def total_blocks(self) -> int:
        return self.hello["total_blocks"]

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)

    def load(self) -> InstanceLoad:
        s = self.stats
        while self.pending and self.pending[0][0] <= s["requests_added"]:
            self.pending.popleft()
        return InstanceLoad(self.index, s["free_blocks"], s["total_blocks"], s["watermark_blocks"],
                            s["waiting_demand_blocks"], s["num_requests_running"], s["num_requests_waiting"],
                            len(self.pending), sum(b for _, b in self.pending),
                            accepting=not self.draining and self.dead is None,
                            running_blocks=tuple(s["running_blocks"]), growth_blocks=s.get("growth_blocks", 0))

    def describe(self) -> dict:
        s, load = self.stats, self.load()
        return {"index": self.index, "layout": self.hello["layout"], "pids": self.hello["pids"],
                "hosts": self.hello.get("hosts", []), "load": -load.freeness, "freeness": load.freeness,
                "free_blocks": s["free_blocks"], "total_blocks": s["total_blocks"],
                "running": list(s["running_ids"]), "waiting": list(s["waiting_ids"]),
                "num_preemptions": s["num_preemptions_total"], "draining": self.draining, "dead": self.dead}


class Cluster:
    """The EngineClient over one or more instances (see serving/api_server.py for the interface)."""

    def __init__(self, clients: list[InstanceClient], model_name: str, tokenizer=None,
                 chat_template: Optional[str] = None, max_queue: int = 1024, dispatch: str = "load",
                 migrate_interval: float = 1.0, migration_timeout: float = 30.0, cooldown_s: Optional[float] = None,
                 on_dead: Optional[Callable[[str], None]] = None):
        first = clients[0].hello
        self.instances = clients
        self.model_name, self.tokenizer, self.chat_template = model_name, tokenizer, chat_template
        self.max_model_len, self.vocab_size = first["max_positions"], first["vocab_size"]
        self.block_size, self.block_bytes = first["block_size"], first["block_bytes"]
        self.max_queue = max_queue
        self.dispatcher = Dispatcher(dispatch)
        self.migrate_interval, self.migration_timeout = migrate_interval, migration_timeout
        self.cooldown_s = cooldown_s if cooldown_s is not None else max(2.0, 5 * migrate_interval)
        self.dead_reason: Optional[str] = None
        self.accepting = True
        self._on_dead = on_dead
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._owner: dict[str, int] = {}
        self._moving: dict[str, tuple[int, int]] = {}  # request -> (src, dst) while it migrates
        self._aborted: set[str] = set()  # aborted by the client while migrating
        self._moved_at: dict[str, float] = {}
        self._busy: Counter = Counter()  # instance -> migrations it takes part in
        self._ids = itertools.count(1)
        self._calls: dict[int, tuple[asyncio.Future, int]] = {}
        self._events: dict[tuple, asyncio.Future] = {}
        self.outcomes: Counter = Counter()
        self.downtime_counts = [0] * (len(DOWNTIME_BUCKETS) + 1)
        self.downtime_sum = 0.0
        self.history: deque[MigrationResult] = deque(maxlen=1000)
        self._stopping = False
        self.loop = asyncio.new_event_loop()
        self._threads: list[threading.Thread] = []

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> None:
        control = threading.Thread(target=self._run_loop, name="cluster-control", daemon=True)
        control.start()
        self._threads.append(control)
        for client in self.instances:
            t = threading.Thread(target=self._read, args=(client,), name=f"instance-{client.index}-reader", daemon=True)
            t.start()
            self._threads.append(t)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.create_task(self._controller())
        self.loop.run_forever()

    def stop(self, timeout: float = 60.0) -> None:
        """Tell every instance to stop (each tells its ranks) and end the control loop."""
        self.accepting = False
        self._stopping = True
        for client in self.instances:
            if client.dead is None:
                try:
                    client.send(("stop",))
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for t in self._threads[1:]:
            t.join(max(0.0, deadline - time.monotonic()))
        self.loop.call_soon_threadsafe(self.loop.stop)

    # -- messages from the instances (one reader thread each) ---------------------------------------------
    def _read(self, client: InstanceClient) -> None:
        while True:
            try:
                message = client.conn.recv()
            except (OSError, EOFError):
                if not self._stopping:
                    self._instance_died(client, "its connection closed")
                return
            kind = message[0]
            if kind == "out":
                self._route(client, message[1])
            elif kind == "stats":
                client.stats = message[1]
            elif kind in ("reply", "event"):
                self.loop.call_soon_threadsafe(self._on_control, client, message)
            elif kind == "dead":
                self._instance_died(client, message[1])
                return

    def _route(self, client: InstanceClient, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
            for o in outputs:
                if o.finished and self._owner.get(o.request_id) == client.index:
                    self._owner.pop(o.request_id, None)
        for target, output in targets:
            if target is not None:
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, output)

    def _on_control(self, client: InstanceClient, message: tuple) -> None:
        if message[0] == "reply":
            _, call_id, ok, value = message
            entry = self._calls.pop(call_id, None)
            if entry is None or entry[0].done():
                return
            if ok:
                entry[0].set_result(value)
            else:
                entry[0].set_exception(MigrationAborted(*value))
        else:
            _, name, args = message
            failed = name == "stage_failed"  # it answers the wait for that stage's stage_done
            key = (client.index, ("stage_done" if failed else name, *args))
            fut = self._events.setdefault(key, self.loop.create_future())
            if not fut.done():
                if failed:
                    fut.set_exception(MigrationAborted("transfer_failed", f"instance {client.index}: a KV transfer "
                                                                          f"of migration {args[0]} stage {args[1]} failed"))
                else:
                    fut.set_result(True)

    def _instance_died(self, client: InstanceClient, reason: str) -> None:
        """An instance failed: its requests end with an error their clients see, its migrations are
        undone, and the other instances serve on. When none is left, the server stops."""
        client.dead = reason
        what = f"instance {client.index} ({client.hello['layout']}): {reason}"
        with self._lock:
            last = all(c.dead is not None for c in self.instances)
            if last:
                self.dead_reason = self.dead_reason or what
                streams = list(self._streams.values())
            else:
                lost = [r for r, i in self._owner.items() if i == client.index]
                streams = [self._streams[r] for r in lost if r in self._streams]
                for r in lost:
                    self._owner.pop(r, None)
        if not last:
            logger.error(f"instance {client.index} failed ({reason}); its {len(streams)} request(s) end with an error, "
                         f"the other instances serve on")
        else:
            logger.error(f"instance {client.index} failed: {reason}")
        self.loop.call_soon_threadsafe(self._fail_calls, client.index)
        error = EngineDeadError(self.dead_reason if last else f"instance {what}")
        for loop, q in streams:
            loop.call_soon_threadsafe(q.put_nowait, error)
        if last and self._on_dead is not None:
            self._on_dead(self.dead_reason)

    def _fail_calls(self, index: int) -> None:
        for call_id, (fut, inst) in list(self._calls.items()):
            if inst == index and not fut.done():
                fut.set_exception(MigrationAborted("instance_died", f"instance {index} died"))

    # -- what migrations call (on the control loop) ---------------------------------------------------
    async def call(self, index: int, method: str, *args, timeout: float, failure: str = "source_failed"):
        """Call a migration method on instance `index`'s driver; MigrationAborted(`failure`) if it
        does not answer within `timeout` or is dead."""
        client = self.instances[index]
        if client.dead is not None:
            raise MigrationAborted(failure, f"instance {index} is dead: {client.dead}")
        call_id = next(self._ids)
        fut = self.loop.create_future()
        self._calls[call_id] = (fut, index)
        try:
            client.send(("call", call_id, method, args))
            return await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, OSError) as exc:
            raise MigrationAborted(failure, f"instance {index} did not answer {method} within {timeout:g} s "
                                            f"({type(exc).__name__})") from None
        except MigrationAborted as exc:
            if exc.outcome == "instance_died":
                raise MigrationAborted(failure, str(exc)) from None
            raise
        finally:
            self._calls.pop(call_id, None)

    async def wait_event(self, index: int, event: tuple, timeout: float, failure: str) -> None:
        """Wait for instance `index` to report `event` (it may have already); MigrationAborted(`failure`)
        if it does not within `timeout` or dies."""
        key = (index, event)
        fut = self._events.setdefault(key, self.loop.create_future())
        deadline = time.monotonic() + timeout
        try:
            while not fut.done():
                if self.instances[index].dead is not None or time.monotonic() > deadline:
                    raise MigrationAborted(failure, f"instance {index} did not report {event[0]} of migration "
                                                    f"{event[1]} stage {event[2]} within {timeout:g} s "
                                                    f"({self.instances[index].dead or 'alive'})")
                await asyncio.wait([fut], timeout=0.05)
            fut.result()  # raises MigrationAborted if the instance reported the stage failed
        finally:
            self._events.pop(key, None)

    def moved(self, request_id: str, src: int, dst: int) -> None:
        """The destination has the request: its outputs come from there now (unless its client left
        or its source died meanwhile: then nobody listens, and the destination drops it)."""
        with self._lock:
            listened = self._owner.get(request_id) == src and request_id not in self._aborted
            if listened:
                self._owner[request_id] = dst
        if not listened:
            self.instances[dst].send(("abort", request_id))

    async def _migrate(self, request_id: str, src: int, dst: int, reason: str, mode: str = "live") -> MigrationResult:
        mid = next(self._ids)
        with self._lock:
            self._moving[request_id] = (src, dst)
        self._busy.update((src, dst))
        try:
            result = await migrate(self, mid, request_id, src, dst, reason, self.migration_timeout, mode)
        finally:
            self._busy.subtract((src, dst))
            with self._lock:
                self._moving.pop(request_id, None)
                self._aborted.discard(request_id)
            for key in [k for k in self._events if k[1][1] == mid]:  # reports nobody waited for
                fut = self._events.pop(key)
                if fut.done() and not fut.cancelled():
                    fut.exception()  # retrieved: no "never retrieved" warning for a failure nobody awaited
        self._moved_at[request_id] = time.monotonic()
        self.outcomes[result.outcome] += 1
        self.history.append(result)
        if result.outcome == "ok":
            self.downtime_sum += result.downtime_s
            bucket = next((i for i, b in enumerate(DOWNTIME_BUCKETS) if result.downtime_s <= b), len(DOWNTIME_BUCKETS))
            self.downtime_counts[bucket] += 1
        return result

    # -- the migration controller ----------------------------------------------------------------------
    async def _controller(self) -> None:
        last = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(TICK_S)
            draining = any(c.draining for c in self.instances)
            due = self.migrate_interval > 0 and time.monotonic() - last >= self.migrate_interval
            if not (draining or due) or self.dead_reason is not None:
                continue
            if due:
                last = time.monotonic()
            try:
                self._rebalance(only_drain=not due)
            except Exception as exc:  # noqa: BLE001 - a bad round must not end the controller
                logger.exception(f"migration controller: {exc}")

    def _rebalance(self, only_drain: bool) -> None:
        now = time.monotonic()
        live = [c for c in self.instances if c.dead is None]
        loads = [c.load() for c in live]
        with self._lock:
            moving = set(self._moving)
        candidates = {}
        for c in live:
            s = c.stats
            cands = [MoveCandidate(r, 0, False) for r in s["waiting_ids"]]
            cands += [MoveCandidate(r, b, True) for r, b in zip(s["running_ids"], s["running_blocks"])]
            candidates[c.index] = [x for x in cands if x.request_id not in moving]
        cooling = {r for r, t in self._moved_at.items() if now - t < self.cooldown_s}
        draining = {c.index for c in live if c.draining}
        busy = {i for i, n in self._busy.items() if n > 0}
        if only_drain:
            loads = [x for x in loads if x.index in draining or x.accepting]
        for move in plan_moves(loads, candidates, busy, cooling, draining):
            if only_drain and move.src not in draining:
                continue
            self.loop.create_task(self._migrate(move.request_id, move.src, move.dst, move.reason))

    # -- admin (thread-safe: called from the HTTP server's loop) -------------------------------------------
    def describe_instances(self) -> list[dict]:
        with self._lock:
            moving = dict(self._moving)
            owner = dict(self._owner)
        out = []
        for c in self.instances:
            d = c.describe()
            d["requests"] = [r for r, i in owner.items() if i == c.index]  # the API's routing: up to date
            d["migrating"] = [r for r, (s, t) in moving.items() if c.index in (s, t)]
            out.append(d)
        return out

    def migrate_now(self, request_id: str, to_instance: int, mode: str = "live") -> concurrent.futures.Future:
        """Force one migration (operators, tests, benchmarks); the future gives its MigrationResult."""
        if mode not in MODES:
            raise AdminError(400, f"mode {mode!r} is not one of {MODES}")
        if not 0 <= to_instance < len(self.instances):
            raise AdminError(400, f"to_instance {to_instance} is not one of the {len(self.instances)} instances")
        with self._lock:
            src = self._owner.get(request_id)
            moving = request_id in self._moving
        if src is None:
            raise AdminError(404, f"request {request_id!r} is not running or waiting on any instance")
        if moving:
            raise AdminError(409, f"request {request_id!r} is already migrating")
        if src == to_instance:
            raise AdminError(400, f"request {request_id!r} is already on instance {to_instance}")
        dst = self.instances[to_instance]
        if dst.dead is not None or dst.draining:
            raise AdminError(409, f"instance {to_instance} takes no requests ({'dead' if dst.dead else 'draining'})")
        return asyncio.run_coroutine_threadsafe(self._migrate(request_id, src, to_instance, "manual", mode), self.loop)

    def drain(self, index: int) -> dict:
        """Stop dispatching to an instance and move everything on it elsewhere."""
        if not 0 <= index < len(self.instances):
            raise AdminError(404, f"instance {index} does not exist (there are {len(self.instances)})")
        others = [c for c in self.instances if c.index != index and c.dead is None and not c.draining]
        if not others:
            raise AdminError(409, f"instance {index} is the last one taking requests; nowhere to drain it to")
        client = self.instances[index]
        client.draining = True
        logger.info(f"draining instance {index}: its requests move to instances {[c.index for c in others]}")
        return client.describe()

    # -- the EngineClient interface ------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        largest = max(self.instances, key=lambda c: c.total_blocks)
        why = check_fits(len(prompt_token_ids), params.max_new_tokens, largest.total_blocks, self.block_size,
                         largest.hello.get("cp", 1))
        if why:
            raise RequestError("max_tokens", f"prompt: {why}")

    def begin_shutdown(self) -> None:
        self.accepting = False

    def abort(self, request_id: str) -> None:
        with self._lock:
            index = self._owner.get(request_id)
            if request_id in self._moving:
                self._aborted.add(request_id)
        if index is not None and self.instances[index].dead is None:
            try:
                self.instances[index].send(("abort", request_id))
            except OSError:
                pass

    def stats(self) -> dict:
        live = [c for c in self.instances if c.dead is None] or self.instances
        per = [dict(c.stats, engine=str(c.index)) for c in live]
        free, total = sum(s["free_blocks"] for s in per), sum(s["total_blocks"] for s in per)
        return {"num_requests_running": sum(s["num_requests_running"] for s in per),
                "num_requests_waiting": sum(s["num_requests_waiting"] for s in per),
                "kv_cache_usage_perc": 1.0 - free / total if total else 0.0,
                "num_preemptions_total": sum(s["num_preemptions_total"] for s in per),
                "free_blocks": free, "total_blocks": total, "instances": per,
                "migrations_total": dict(self.outcomes),
                "migration_downtime": (DOWNTIME_BUCKETS, list(self.downtime_counts), self.downtime_sum)}

    def _num_queued(self) -> int:
        with self._lock:
            open_streams = len(self._streams)
        running = sum(c.stats["num_requests_running"] for c in self.instances)
        return max(0, open_streams - running)

    def _dispatch(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> InstanceClient:
        need = blocks_at_full_length(len(prompt_token_ids), params.max_new_tokens, self.block_size,
                                     self.instances[0].hello.get("cp", 1))
        with self._lock:
            index = self.dispatcher.choose([c.load() for c in self.instances], need)
            if index is None:
                raise QueueFullError(retry_after_s=5.0)
            client = self.instances[index]
            client.sent += 1
            client.pending.append((client.sent, need))
            self._owner[request_id] = index
        return client

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self.accepting:
            raise QueueFullError(retry_after_s=5.0)
        if self._num_queued() >= self.max_queue:
            raise QueueFullError(retry_after_s=1.0)
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            client = self._dispatch(request_id, prompt_token_ids, params)
            client.send(("add", request_id, list(prompt_token_ids), params))
            while not finished:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestError("prompt", item.error)
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)  # the client went away, or an error: free its blocks
            with self._lock:
                self._owner.pop(request_id, None)

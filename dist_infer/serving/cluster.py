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
import secrets
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import AsyncIterator, Callable, Optional

from loguru import logger

from dist_infer.engine.kv_transfer import PeerInstance
from dist_infer.engine.migration import MigrationAborted
from dist_infer.engine.request import RequestError, RequestOutput, check_prompt
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.scheduler import blocks_at_full_length, check_fits
from dist_infer.serving.dispatch import Dispatcher, InstanceLoad
from dist_infer.serving.errors import EngineDeadError, QueueFullError, RequestFailedError
from dist_infer.serving.instances import InstanceSpec, InstancesError, parse_instances
from dist_infer.serving.migration import MAX_STAGES, MODES, MigrationResult, migrate
from dist_infer.serving.rebalance import MoveCandidate, plan_moves

DOWNTIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TICK_S = 0.05  # how often the controller looks at draining and stopping instances
PD_RETRY_S = 0.5  # a request whose hand-over to a decode instance failed tries again after this
Spawner = Callable[[int, InstanceSpec], object]  # starts instance i as a job of its own; returns its process


@dataclass
class Progress:
    """What a request's client has been sent: enough to resume it on another instance."""

    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    first_token: Optional[float] = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    text_chars: int = 0

    def add(self, output: RequestOutput) -> None:
        if output.new_token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        self.token_ids += output.new_token_ids
        self.logprobs += output.new_logprobs
        self.top_logprobs += output.new_top_logprobs
        self.text_chars += len(output.text_delta)

    def wire(self) -> dict:
        now = time.monotonic()
        return {"token_ids": list(self.token_ids), "logprobs": list(self.logprobs),
                "top_logprobs": list(self.top_logprobs), "text_chars": self.text_chars, "age_s": now - self.arrival,
                "first_token_age_s": None if self.first_token is None else now - self.first_token}


@dataclass
class RequestRecord:
    """Everything the front end holds for one request: made when it arrives, removed in one place
    (the end of `Cluster.generate`), so nothing about a request outlives it. A late message about
    an ended request (an output, a migration's end, a hand-over retry) finds no record and does nothing."""

    progress: Progress
    stream: tuple  # (the client's event loop, its queue)
    owner: Optional[int] = None  # the instance that runs it (None: finished, parked or failed)
    moving: Optional[tuple[int, int]] = None  # (src, dst) while it migrates; dst -1: its copy there is aborted
    aborted: bool = False  # its client left while it migrated
    moved_at: float = float("-inf")  # when its last migration ended (the controller's cooldown)
    pd_next: float = 0.0  # when its hand-over to a decode instance may be tried
    recovering: Optional[tuple[float, int]] = None  # (when its instance died, which) until it streams again
    parked: bool = False  # its instance died and it waits for one that is starting
    failovers: int = 0  # instances that died while running it


class AdminError(ValueError):
    """An admin request that cannot be done; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class InstanceClient:
    """One instance as the API process sees it: its connection, its last reported load, the
    requests sent to it that it has not reported yet, and where it is in its life:
    starting -> serving -> (stopping -> stopped | dead), and from stopped or dead, starting again."""

    def __init__(self, index: int, conn: Optional[Connection] = None, hello: Optional[dict] = None,
                 spec: Optional[InstanceSpec] = None):
        self.index = index
        self.conn: Optional[Connection] = None
        self.hello: Optional[dict] = None
        self.spec = spec
        self.state = "starting"
        self.draining = False
        self.dead: Optional[str] = None  # why it died (the last time)
        self.restarts = 0
        self.process = None  # the job this API process started for it (restart, scale-up)
        self.stop_sent = False
        self._lock = threading.Lock()
        self.stats: dict = {}
        self.sent = 0
        self.pending: deque[tuple[int, int]] = deque()
        self.incoming: dict[str, int] = {}  # requests migrating here -> their blocks at full length
        self._pending_lock = threading.Lock()
        if conn is not None:
            self.attach(conn, hello)

    def attach(self, conn: Connection, hello: dict) -> None:
        """Its driver connected and said hello: it serves from now on (again, after a restart)."""
        self.conn, self.hello = conn, hello
        self.spec = InstanceSpec(hello["tp"], hello["pp"], hello.get("role", "mixed"))
        self.stats = {"free_blocks": hello["total_blocks"], "total_blocks": hello["total_blocks"],
                      "num_requests_running": 0, "num_requests_waiting": 0, "requests_added": 0,
                      "running_ids": [], "waiting_ids": [], "running_blocks": [], "num_preemptions_total": 0,
                      "kv_cache_usage_perc": 0.0, "watermark_blocks": 0, "waiting_demand_blocks": 0}
        self.sent = 0  # add messages sent (the instance counts those it applied)
        self.pending = deque()  # (add number, blocks its prompt needs)
        self.draining = self.stop_sent = False
        self.state = "serving"

    @property
    def alive(self) -> bool:
        return self.state in ("serving", "stopping") and self.conn is not None

    @property
    def accepting(self) -> bool:
        return self.state == "serving" and not self.draining

    @property
    def role(self) -> str:
        return self.spec.role if self.spec is not None else "mixed"

    @property
    def total_blocks(self) -> int:
        return self.hello["total_blocks"] if self.hello else 0

    def peer(self) -> PeerInstance:
        return PeerInstance.from_hello(self.hello)

    def send(self, message: tuple) -> None:
        with self._lock:
            if self.conn is None:
                raise OSError(f"instance {self.index} is not connected")
            self.conn.send(message)

    def load(self) -> InstanceLoad:
        s = self.stats
        if not s:
            return InstanceLoad(self.index, 0, 0, accepting=False)
        with self._pending_lock:
            while self.pending and self.pending[0][0] <= s["requests_added"]:
                self.pending.popleft()
            pending = list(self.pending)
        incoming = dict(self.incoming)
        return InstanceLoad(self.index, s["free_blocks"], s["total_blocks"], s["watermark_blocks"],
                            s["waiting_demand_blocks"], s["num_requests_running"], s["num_requests_waiting"],
                            len(pending) + len(incoming), sum(b for _, b in pending) + sum(incoming.values()),
                            accepting=self.accepting,
                            running_blocks=tuple(s["running_blocks"]), growth_blocks=s.get("growth_blocks", 0))

    def describe(self) -> dict:
        s, load = self.stats, self.load()
        h = self.hello or {}
        return {"index": self.index, "state": self.state, "role": self.role,
                "layout": self.spec.layout if self.spec else h.get("layout"), "pids": h.get("pids", []),
                "hosts": h.get("hosts", []), "links": [f"{a[0]}:{a[1]}" for a in h.get("addresses", [])],
                "load": -load.freeness, "freeness": load.freeness,
                "free_blocks": s.get("free_blocks", 0), "total_blocks": s.get("total_blocks", 0),
                "running": list(s.get("running_ids", [])), "waiting": list(s.get("waiting_ids", [])),
                "num_preemptions": s.get("num_preemptions_total", 0), "draining": self.draining,
                "dead": self.dead if self.state == "dead" else None, "last_failure": self.dead,
                "restarts": self.restarts}


class Cluster:
    """The EngineClient over one or more instances (see serving/api_server.py for the interface)."""

    def __init__(self, clients: list[InstanceClient], model_name: str, tokenizer=None,
                 chat_template: Optional[str] = None, max_queue: int = 1024, dispatch: str = "load",
                 migrate_interval: float = 1.0, migration_timeout: float = 30.0, cooldown_s: Optional[float] = None,
                 on_dead: Optional[Callable[[str], None]] = None, spawner: Optional[Spawner] = None,
                 join_timeout_s: float = 300.0, max_request_failovers: int = 1, max_instances: int = 16):
        first = clients[0].hello
        self.instances = clients
        self.model_name, self.tokenizer, self.chat_template = model_name, tokenizer, chat_template
        self.max_model_len, self.vocab_size = first["max_positions"], first["vocab_size"]
        self.block_size, self.block_bytes = first["block_size"], first["block_bytes"]
        self.cp = first.get("cp", 1)
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
        self._lock = threading.RLock()
        self._requests: dict[str, RequestRecord] = {}
        self._busy: Counter = Counter()  # instance -> migrations it takes part in
        self._active_migrations: set[int] = set()  # their ids: random, so no one can guess the next one's KV keys
        self._ids = itertools.count(1)  # call ids (each answered on its own instance's connection)
        self._calls: dict[int, tuple[asyncio.Future, int]] = {}
        self._events: dict[tuple, asyncio.Future] = {}
        self.outcomes: Counter = Counter()
        self.downtime_counts = [0] * (len(DOWNTIME_BUCKETS) + 1)
        self.downtime_sum = 0.0
        self.recovery_counts = [0] * (len(RECOVERY_BUCKETS) + 1)
        self.recovery_sum = 0.0
        self.recoveries: deque[dict] = deque(maxlen=1000)  # {request_id, instance, seconds}
        self.failures = 0  # instances that died
        self.requests_lost = 0  # ended with an error because their instance died and none could take them
        self.requests_quarantined = 0  # failed because the instances running them died too often
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
            self._start_reader(client)

    def _start_reader(self, client: InstanceClient) -> None:
        t = threading.Thread(target=self._read, args=(client, client.conn), name=f"instance-{client.index}-reader",
                             daemon=True)
        t.start()
        self._threads.append(t)

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
                    client.send(("stop",))
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

    # -- instances joining (the hub's accept thread) -------------------------------------------------
    def attach(self, conn: Connection, hello: dict) -> None:
        """A driver connected after start-up: a restarted instance, or a new one (scale-up)."""
        index = hello.get("index")
        problem = None
        if (hello.get("vocab_size"), hello.get("block_size"), hello.get("max_positions")) != \
                (self.vocab_size, self.block_size, self.max_model_len):
            problem = "it serves another model (vocabulary, block size or positions differ)"
        with self._lock:
            if problem is None and isinstance(index, int) and index == len(self.instances):
                self.instances.append(InstanceClient(index))
            if problem is None and not (isinstance(index, int) and 0 <= index < len(self.instances)):
                problem = f"there is no instance {index} (there are {len(self.instances)}; a new one takes the next index)"
            elif problem is None and self.instances[index].state not in ("starting", "dead", "stopped"):
                problem = f"instance {index} is {self.instances[index].state}"
            if problem is None:
                client = self.instances[index]
                client.attach(conn, hello)
                parked = self._unpark()
        if problem is not None:
            logger.error(f"an instance driver wanted to join as instance {index}, refused: {problem}")
            conn.close()
            return
        logger.info(f"instance {index} ({client.spec.describe()}, pids {hello.get('pids')}) joined; it takes requests")
        self._start_reader(client)
        for request_id in parked:
            self._redispatch(request_id, "an instance joined")

    def _unpark(self) -> list[str]:
        """(lock held) The requests waiting for an instance to start; they are dispatched again."""
        parked = [r for r, rec in self._requests.items() if rec.parked]
        for r in parked:
            self._requests[r].parked = False
        return parked

    # -- messages from the instances (one reader thread each) ---------------------------------------------
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
            kind = message[0]
            if client.conn is not conn:
                return  # declared dead from elsewhere (a failed send): its requests went on from their progress
            if kind == "out":
                self._route(client, message[1])
            elif kind == "stats":
                client.stats = message[1]
            elif kind in ("reply", "event"):
                self._soon(self._on_control, client, message)
            elif kind == "dead":
                if client.conn is conn:
                    self._instance_died(client, message[1])
                return

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
                rec.progress.add(o)
                if o.finished and rec.owner == client.index:
                    rec.owner = None
                if o.new_token_ids and rec.recovering is not None:
                    (died_at, dead), rec.recovering = rec.recovering, None
                    self._record_recovery(o.request_id, dead, now - died_at)
                if client.role == "prefill" and not o.finished and o.new_token_ids and rec.owner == client.index \
                        and rec.moving is None and rec.pd_next <= now:
                    rec.pd_next = float("inf")  # until this hand-over is over
                    handover.append(o.request_id)
        for (loop, q), output in targets:
            loop.call_soon_threadsafe(q.put_nowait, output)
        for request_id in handover:
            self._soon(self._hand_to_decode, request_id, client.index)

    def _record_recovery(self, request_id: str, dead: int, seconds: float) -> None:
        self.recovery_sum += seconds
        bucket = next((i for i, b in enumerate(RECOVERY_BUCKETS) if seconds <= b), len(RECOVERY_BUCKETS))
        self.recovery_counts[bucket] += 1
        self.recoveries.append({"request_id": request_id, "instance": dead, "seconds": seconds})
        logger.info(f"request {request_id} streams again {seconds * 1e3:.0f} ms after instance {dead} died")

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
            if not args or args[0] not in self._active_migrations:
                return  # a report of a migration that is over: nobody waits for it, nothing is kept
            failed = name == "stage_failed"  # it answers the wait for that stage's stage_done
            key = (client.index, ("stage_done" if failed else name, *args))
            fut = self._events.setdefault(key, self.loop.create_future())
            if not fut.done():
                if failed:
                    fut.set_exception(MigrationAborted("transfer_failed", f"instance {client.index}: a KV transfer "
                                                                          f"of migration {args[0]} stage {args[1]} failed"))
                else:
                    fut.set_result(True)

    def _instance_stopped(self, client: InstanceClient) -> None:
        client.state, client.conn = "stopped", None
        logger.info(f"instance {client.index} ({client.spec.describe()}) stopped")
        self._soon(self._fail_calls, client.index)

    def _instance_died(self, client: InstanceClient, reason: str) -> None:
        """An instance failed: its requests go on elsewhere (prefilled again from their tokens so
        far), its migrations are undone, and the other instances serve on. When no instance is
        left (none serving, none starting), the server stops."""
        now = time.monotonic()
        with self._lock:
            if client.state == "dead":
                return
            client.state, client.dead, client.conn = "dead", reason, None
            self.failures += 1
            what = f"instance {client.index} ({client.spec.describe()}): {reason}"
            left = [c for c in self.instances if c.state in ("serving", "stopping", "starting")]
            orphans, moving, streams = [], set(), []
            if not left:
                self.dead_reason = self.dead_reason or what
                streams = [rec.stream for rec in self._requests.values()]
            else:
                queued = set(client.stats.get("waiting_ids", ()))
                for r, rec in self._requests.items():
                    if rec.owner == client.index:
                        orphans.append(r)
                        rec.recovering = (now, client.index)
                        if r not in queued and rec.moving is None:
                            rec.failovers += 1  # it may have been in the step that killed the instance
                        if rec.moving is not None:
                            moving.add(r)
        self._soon(self._fail_calls, client.index)
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

    def _no_instance_left(self) -> EngineDeadError:
        """What clients are told: that no instance is left, not why (the why, an instance's error
        text, goes to the log and /admin/instances only)."""
        return EngineDeadError("no model instance is left to serve requests; the server log says why")

    def _fail_calls(self, index: int) -> None:
        for call_id, (fut, inst) in list(self._calls.items()):
            if inst == index and not fut.done():
                fut.set_exception(MigrationAborted("instance_died", f"instance {index} died"))

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
                roles = ("decode", "mixed") if progress.token_ids else ("prefill", "mixed")
                index = self._choose(len(progress.prompt_token_ids), progress.params, roles, force=True)
                if index is None and any(c.state == "starting" for c in self.instances):
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
            self.instances[index].send(("resume", request_id, progress.prompt_token_ids, progress.params,
                                        progress.wire()))
        except OSError:
            self._instance_died(self.instances[index], "its connection failed")
            return
        with self._lock:
            left = request_id not in self._requests
        if left:  # its client went away while it was being sent: an abort sent before the resume did nothing
            self.abort_on(index, request_id)

    # -- what migrations call (on the control loop) ---------------------------------------------------
    def peer(self, index: int) -> PeerInstance:
        return self.instances[index].peer()

    async def call(self, index: int, method: str, *args, timeout: float, failure: str = "source_failed"):
        """Call a migration method on instance `index`'s driver; MigrationAborted(`failure`) if it
        does not answer within `timeout` or is dead."""
        client = self.instances[index]
        if not client.alive:
            raise MigrationAborted(failure, f"instance {index} is {client.state}: {client.dead or ''}")
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

    async def wait_event(self, index: int, event: tuple, timeout: float, failure: str,
                         watch: tuple[int, ...] = ()) -> None:
        """Wait for instance `index` to report `event` (it may have already); MigrationAborted(`failure`)
        if it does not within `timeout`, or it (or an instance in `watch`) dies."""
        key = (index, event)
        fut = self._events.setdefault(key, self.loop.create_future())
        deadline = time.monotonic() + timeout
        try:
            while not fut.done():
                gone = [i for i in (index, *watch) if not self.instances[i].alive]
                if gone or time.monotonic() > deadline:
                    why = f"instance {gone[0]} is {self.instances[gone[0]].state}" if gone else "alive"
                    raise MigrationAborted(failure if not gone or gone[0] == index else
                                           ("source_failed" if failure == "dest_failed" else "dest_failed"),
                                           f"instance {index} did not report {event[0]} of migration {event[1]} "
                                           f"stage {event[2]} within {timeout:g} s ({why})")
                await asyncio.wait([fut], timeout=0.05)
            fut.result()  # raises MigrationAborted if the instance reported the stage failed
        finally:
            self._events.pop(key, None)

    def abort_on(self, index: int, request_id: str) -> None:
        """End a request on one instance, whatever the API's routing says (a late copy of it), and
        stream nothing more from it there."""
        with self._lock:
            rec = self._requests.get(request_id)
            if rec is not None and rec.moving is not None and rec.moving[1] == index:
                rec.moving = (rec.moving[0], -1)
        if self.instances[index].alive:
            try:
                self.instances[index].send(("abort", request_id))
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
                self.instances[dst].send(("abort", request_id))
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
                    rec.pd_next = time.monotonic() + PD_RETRY_S if result.outcome != "ok" else float("inf")
        self.outcomes[result.outcome] += 1
        self.history.append(result)
        if result.outcome == "ok":
            self.downtime_sum += result.downtime_s
            bucket = next((i for i, b in enumerate(DOWNTIME_BUCKETS) if result.downtime_s <= b), len(DOWNTIME_BUCKETS))
            self.downtime_counts[bucket] += 1
        return result

    def _expect(self, rec: RequestRecord, request_id: str, dst: int) -> None:
        """(lock held) A request on its way to `dst` counts in its load until the move is over, so
        moves chosen in the same instant spread out instead of all picking the same instance."""
        self.instances[dst].incoming[request_id] = blocks_at_full_length(
            len(rec.progress.prompt_token_ids), rec.progress.params.max_new_tokens, self.block_size, self.cp)

    # -- prefill/decode disaggregation ------------------------------------------------------------------
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
            dst = self._choose(len(rec.progress.prompt_token_ids), rec.progress.params, ("decode", "mixed"),
                               queued=False)
            if dst is None or dst == src:
                rec.pd_next = time.monotonic() + PD_RETRY_S
                return
            self._expect(rec, request_id, dst)  # before the migration task starts: the next choice sees it
        self.loop.create_task(self._migrate(request_id, src, dst, "pd", max_stages=0))

    # -- the migration controller ----------------------------------------------------------------------
    async def _controller(self) -> None:
        last = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(TICK_S)
            draining = any(c.draining and c.alive for c in self.instances)
            due = self.migrate_interval > 0 and time.monotonic() - last >= self.migrate_interval
            if self.dead_reason is not None:
                continue
            try:
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
        live = [c for c in self.instances if c.alive and (c.role != "prefill" or c.draining)]
        loads = [c.load() for c in live]
        with self._lock:
            moving = {r for r, rec in self._requests.items() if rec.moving is not None}
            cooling = {r for r, rec in self._requests.items() if now - rec.moved_at < self.cooldown_s}
        candidates = {}
        for c in live:
            s = c.stats
            cands = [MoveCandidate(r, 0, False) for r in s["waiting_ids"]]
            cands += [MoveCandidate(r, b, True) for r, b in zip(s["running_ids"], s["running_blocks"])]
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
            if c.state != "stopping" or c.stop_sent or not c.alive:
                continue
            with self._lock:
                held = any(rec.owner == c.index for rec in self._requests.values())
            s = c.stats
            if held or s.get("num_requests_running") or s.get("num_requests_waiting") or self._busy[c.index] > 0:
                continue
            c.stop_sent = True
            logger.info(f"instance {c.index} is drained; stopping it")
            try:
                c.send(("stop",))
            except OSError:
                pass

    # -- admin (thread-safe: called from the HTTP server's loop) -------------------------------------------
    def describe_instances(self) -> list[dict]:
        with self._lock:
            moving = {r: rec.moving for r, rec in self._requests.items() if rec.moving is not None}
            owner = {r: rec.owner for r, rec in self._requests.items() if rec.owner is not None}
        out = []
        for c in self.instances:
            d = c.describe()
            d["requests"] = [r for r, i in owner.items() if i == c.index]  # the API's routing: up to date
            d["migrating"] = [r for r, (s, t) in moving.items() if c.index in (s, t)]
            out.append(d)
        return out

    def _instance(self, index: int) -> InstanceClient:
        if not 0 <= index < len(self.instances):
            raise AdminError(404, f"instance {index} does not exist (there are {len(self.instances)})")
        return self.instances[index]

    def migrate_now(self, request_id: str, to_instance: int, mode: str = "live") -> concurrent.futures.Future:
        """Force one migration (operators, tests, benchmarks); the future gives its MigrationResult."""
        if mode not in MODES:
            raise AdminError(400, f"mode {mode!r} is not one of {MODES}")
        if not 0 <= to_instance < len(self.instances):
            raise AdminError(400, f"to_instance {to_instance} is not one of the {len(self.instances)} instances")
        with self._lock:
            rec = self._requests.get(request_id)
            src = rec.owner if rec is not None else None
            moving = rec is not None and rec.moving is not None
        if src is None:
            raise AdminError(404, f"request {request_id!r} is not running or waiting on any instance")
        if moving:
            raise AdminError(409, f"request {request_id!r} is already migrating")
        if src == to_instance:
            raise AdminError(400, f"request {request_id!r} is already on instance {to_instance}")
        dst = self.instances[to_instance]
        if not dst.accepting:
            raise AdminError(409, f"instance {to_instance} takes no requests ({dst.state}"
                                  f"{', draining' if dst.draining else ''})")
        if not self.instances[src].alive:
            raise AdminError(409, f"request {request_id!r} is on instance {src}, which is {self.instances[src].state}")
        return asyncio.run_coroutine_threadsafe(self._migrate(request_id, src, to_instance, "manual", mode), self.loop)

    def _others_accepting(self, index: int) -> list[InstanceClient]:
        return [c for c in self.instances if c.index != index and c.accepting]

    def drain(self, index: int) -> dict:
        """Stop dispatching to an instance and move everything on it elsewhere."""
        client = self._instance(index)
        if not client.alive:
            raise AdminError(409, f"instance {index} is {client.state}")
        others = self._others_accepting(index)
        if not others:
            raise AdminError(409, f"instance {index} is the last one taking requests; nowhere to drain it to")
        client.draining = True
        logger.info(f"draining instance {index}: its requests move to instances {[c.index for c in others]}")
        return client.describe()

    def stop_instance(self, index: int) -> dict:
        """Scale down: drain the instance, then stop it once it holds nothing (no request is lost)."""
        client = self._instance(index)
        if client.state != "serving":
            raise AdminError(409, f"instance {index} is {client.state}")
        self.drain(index)
        client.state = "stopping"
        logger.info(f"stopping instance {index} once it is drained")
        return client.describe()

    def restart_instance(self, index: int) -> dict:
        """Start a dead or stopped instance again (a job of its own, on this host); it rejoins dispatch
        once its driver connects."""
        client = self._instance(index)
        if client.state not in ("dead", "stopped"):
            raise AdminError(409, f"instance {index} is {client.state}; only a dead or stopped one can be restarted")
        return self._spawn(client, client.spec, "restart")

    def add_instance(self, layout: str) -> dict:
        """Scale up: start one more instance of `layout` (like one --instances item, e.g. tp1 or decode:tp2)."""
        try:
            specs = parse_instances(layout)
        except InstancesError as exc:
            raise AdminError(400, str(exc)) from None
        if len(specs) != 1:
            raise AdminError(400, f"layout {layout!r}: one instance at a time")
        with self._lock:
            if len(self.instances) >= self.max_instances:
                raise AdminError(409, f"the server has {len(self.instances)} instances, --max-instances "
                                      f"{self.max_instances}; restart a dead or stopped one instead")
            client = InstanceClient(len(self.instances), spec=specs[0])
            client.state = "stopped"
            self.instances.append(client)
        return self._spawn(client, specs[0], "scale-up")

    def _spawn(self, client: InstanceClient, spec: InstanceSpec, why: str) -> dict:
        if self._spawner is None:
            raise AdminError(501, "this server cannot start instances (start one with `dist-infer serve --join`)")
        client.state = "starting"
        if why == "restart":
            client.restarts += 1
        logger.info(f"starting instance {client.index} ({spec.describe()}, {why})")
        try:
            client.process = self._spawner(client.index, spec)
        except Exception as exc:  # noqa: BLE001 - the operator sees why
            client.state, client.dead = "dead", f"could not start: {exc}"
            raise AdminError(500, f"instance {client.index} could not start: {exc}") from None
        threading.Thread(target=self._watch_start, args=(client, client.process), daemon=True,
                         name=f"instance-{client.index}-start").start()
        return client.describe()

    def _watch_start(self, client: InstanceClient, process) -> None:
        """A started job that exits, or does not join within join_timeout_s, has failed to start."""
        import subprocess

        try:
            code = f"exited with code {process.wait(self.join_timeout_s)}"
        except subprocess.TimeoutExpired:
            code = f"did not join within {self.join_timeout_s:g} s (stopped)"
        with self._lock:
            failed = client.process is process and client.state == "starting"
            if failed:
                client.state, client.dead = "dead", f"its job {code} before joining"
            parked = []
            if failed and not any(c.state == "starting" for c in self.instances):
                parked = self._unpark()
        if not failed:
            return
        if process.poll() is None:
            process.kill()
        logger.error(f"instance {client.index}: {client.dead}")
        for request_id in parked:
            self._redispatch(request_id, f"instance {client.index} could not start")

    # -- the EngineClient interface ------------------------------------------------------------------
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
                self.instances[index].send(("abort", request_id))
            except OSError:
                pass

    def stats(self) -> dict:
        live = [c for c in self.instances if c.alive] or [c for c in self.instances if c.stats][:1]
        per = [dict(c.stats, engine=str(c.index)) for c in live]
        free, total = sum(s["free_blocks"] for s in per), sum(s["total_blocks"] for s in per)
        return {"num_requests_running": sum(s["num_requests_running"] for s in per),
                "num_requests_waiting": sum(s["num_requests_waiting"] for s in per),
                "kv_cache_usage_perc": 1.0 - free / total if total else 0.0,
                "num_preemptions_total": sum(s["num_preemptions_total"] for s in per),
                "free_blocks": free, "total_blocks": total, "instances": per,
                "migrations_total": dict(self.outcomes),
                "migration_downtime": (DOWNTIME_BUCKETS, list(self.downtime_counts), self.downtime_sum),
                "requests_recovered": (RECOVERY_BUCKETS, list(self.recovery_counts), self.recovery_sum),
                "requests_lost_total": self.requests_lost, "instance_failures_total": self.failures,
                "requests_quarantined_total": self.requests_quarantined, "frontend_entries": self.held()}

    def _num_queued(self) -> int:
        with self._lock:
            open_streams = len(self._requests)
        running = sum(c.stats.get("num_requests_running", 0) for c in self.instances if c.alive)
        return max(0, open_streams - running)

    def _choose(self, prompt_len: int, params: SamplingParams, roles: tuple[str, ...],
                force: bool = False, queued: bool = True) -> Optional[int]:
        """The instance for a request (with the lock held): among those accepting, the ones of the
        roles asked for (any, if none of them accepts); `force`: if none has room, still the least
        loaded (it queues there). `queued`: it arrives as an add the instance will count."""
        need = blocks_at_full_length(prompt_len, params.max_new_tokens, self.block_size, self.cp)
        accepting = [c for c in self.instances if c.accepting]
        pool = [c for c in accepting if c.role in roles] or accepting
        loads = [c.load() for c in pool]
        index = self.dispatcher.choose(loads, need)
        if index is None and force and loads:
            index = max(loads, key=lambda x: (x.freeness, -x.index)).index
        if index is not None and queued:
            client = self.instances[index]
            with client._pending_lock:
                client.sent += 1
                client.pending.append((client.sent, need))
        return index

    def _dispatch(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> InstanceClient:
        with self._lock:
            index = self._choose(len(prompt_token_ids), params, ("prefill", "mixed"))
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
                client.send(("add", request_id, list(prompt_token_ids), params))
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

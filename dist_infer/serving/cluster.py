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
from dist_infer.serving.errors import EngineDeadError, QueueFullError
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
                "hosts": h.get("hosts", []), "load": -load.freeness, "freeness": load.freeness,
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
                 join_timeout_s: float = 300.0):
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
        self._lock = threading.RLock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._owner: dict[str, int] = {}
        self._progress: dict[str, Progress] = {}
        self._moving: dict[str, tuple[int, int]] = {}  # request -> (src, dst) while it migrates
        self._aborted: set[str] = set()  # aborted by the client while migrating
        self._moved_at: dict[str, float] = {}
        self._pd_next: dict[str, float] = {}  # request -> when its hand-over to a decode instance may be tried
        self._parked: list[str] = []  # requests of a dead instance waiting for one that is starting
        self._recovering: dict[str, tuple[float, int]] = {}  # request -> (when its instance died, which)
        self._busy: Counter = Counter()  # instance -> migrations it takes part in
        self._ids = itertools.count(1)
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
        asyncio.set_event_loop(self.loop)
        self.loop.create_task(self._controller())
        self.loop.run_forever()

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
        self.loop.call_soon_threadsafe(self.loop.stop)

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
                parked, self._parked = self._parked, []
        if problem is not None:
            logger.error(f"an instance driver wanted to join as instance {index}, refused: {problem}")
            conn.close()
            return
        logger.info(f"instance {index} ({client.spec.describe()}, pids {hello.get('pids')}) joined; it takes requests")
        self._start_reader(client)
        for request_id in parked:
            self._redispatch(request_id, "an instance joined")

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
                self.loop.call_soon_threadsafe(self._on_control, client, message)
            elif kind == "dead":
                if client.conn is conn:
                    self._instance_died(client, message[1])
                return

    def _route(self, client: InstanceClient, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        handover = []
        with self._lock:
            # only from where the request runs (or is being taken over): a late copy elsewhere is never streamed
            outputs = [o for o in outputs if self._owner.get(o.request_id) == client.index
                       or self._moving.get(o.request_id, (None, None))[1] == client.index]
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
            for o in outputs:
                progress = self._progress.get(o.request_id)
                if progress is not None:
                    progress.add(o)
                if o.finished and self._owner.get(o.request_id) == client.index:
                    self._owner.pop(o.request_id, None)
                if o.new_token_ids and o.request_id in self._recovering:
                    died_at, dead = self._recovering.pop(o.request_id)
                    self._record_recovery(o.request_id, dead, now - died_at)
                if client.role == "prefill" and not o.finished and o.new_token_ids \
                        and self._owner.get(o.request_id) == client.index and o.request_id not in self._moving \
                        and self._pd_next.get(o.request_id, 0.0) <= now:
                    self._pd_next[o.request_id] = float("inf")  # until this hand-over is over
                    handover.append(o.request_id)
        for target, output in targets:
            if target is not None:
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, output)
        for request_id in handover:
            self.loop.call_soon_threadsafe(self._hand_to_decode, request_id, client.index)

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
        self.loop.call_soon_threadsafe(self._fail_calls, client.index)

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
            if not left:
                self.dead_reason = self.dead_reason or what
                streams = list(self._streams.values())
                orphans = []
            else:
                streams = []
                orphans = [r for r, i in self._owner.items() if i == client.index]
                for r in orphans:
                    self._recovering[r] = (now, client.index)
        self.loop.call_soon_threadsafe(self._fail_calls, client.index)
        if not left:
            logger.error(f"instance {client.index} failed: {reason}; no instance is left")
            error = EngineDeadError(self.dead_reason)
            for loop, q in streams:
                loop.call_soon_threadsafe(q.put_nowait, error)
            if self._on_dead is not None:
                self._on_dead(self.dead_reason)
            return
        logger.error(f"instance {client.index} failed ({reason}); its {len(orphans)} request(s) go on on the other "
                     f"instances, prefilled again from their tokens so far")
        with self._lock:
            moving = set(self._moving)
        for request_id in orphans:
            if request_id not in moving:  # a migrating one is settled when its migration ends
                self._redispatch(request_id, f"instance {client.index} died")

    def _fail_calls(self, index: int) -> None:
        for call_id, (fut, inst) in list(self._calls.items()):
            if inst == index and not fut.done():
                fut.set_exception(MigrationAborted("instance_died", f"instance {index} died"))

    def _redispatch(self, request_id: str, why: str) -> None:
        """Send a request whose instance is gone to another, with what its client already has."""
        with self._lock:
            progress = self._progress.get(request_id)
            listened = request_id in self._streams
            owner = self._owner.get(request_id)
            if progress is None or not listened or (owner is not None and self.instances[owner].alive):
                self._recovering.pop(request_id, None)
                if not listened and owner is not None and not self.instances[owner].alive:
                    self._owner.pop(request_id, None)
                return
            roles = ("decode", "mixed") if progress.token_ids else ("prefill", "mixed")
            index = self._choose(len(progress.prompt_token_ids), progress.params, roles, force=True)
            if index is None:
                if any(c.state == "starting" for c in self.instances):
                    self._parked.append(request_id)  # goes on once an instance has joined
                    self._owner.pop(request_id, None)
                    logger.warning(f"request {request_id}: no instance takes requests now; it waits for the one starting")
                    return
                target = self._streams[request_id]
                self._owner.pop(request_id, None)
                self._recovering.pop(request_id, None)
                self.requests_lost += 1
            else:
                self._owner[request_id] = index
        if index is None:
            logger.error(f"request {request_id}: {why} and no instance is left to take it; it ends with an error")
            target[0].call_soon_threadsafe(target[1].put_nowait, EngineDeadError(f"{why}; no instance could take "
                                                                                f"request {request_id} over"))
            return
        logger.info(f"request {request_id} ({len(progress.token_ids)} tokens so far) goes on on instance {index} ({why})")
        try:
            self.instances[index].send(("resume", request_id, progress.prompt_token_ids, progress.params,
                                        progress.wire()))
        except OSError:
            self._instance_died(self.instances[index], "its connection failed")
            return
        with self._lock:
            left = request_id not in self._streams
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
            move = self._moving.get(request_id)
            if move is not None and move[1] == index:
                self._moving[request_id] = (move[0], -1)
        if self.instances[index].alive:
            try:
                self.instances[index].send(("abort", request_id))
            except OSError:
                pass

    def moved(self, request_id: str, src: int, dst: int) -> None:
        """The destination has the request: its outputs come from there now (unless its client left
        meanwhile: then nobody listens, and the destination drops it)."""
        with self._lock:
            listened = self._owner.get(request_id) == src and request_id not in self._aborted \
                and request_id in self._streams
            if listened:
                self._owner[request_id] = dst
        if not listened:
            try:
                self.instances[dst].send(("abort", request_id))
            except OSError:
                pass

    async def _migrate(self, request_id: str, src: int, dst: int, reason: str, mode: str = "live",
                       max_stages: int = MAX_STAGES) -> MigrationResult:
        mid = next(self._ids)
        with self._lock:
            self._moving[request_id] = (src, dst)
            self._expect(request_id, dst)
        self._busy.update((src, dst))
        try:
            result = await migrate(self, mid, request_id, src, dst, reason, self.migration_timeout, mode, max_stages)
        finally:
            self._busy.subtract((src, dst))
            with self._lock:
                self._moving.pop(request_id, None)
                self.instances[dst].incoming.pop(request_id, None)
                self._aborted.discard(request_id)
                owner = self._owner.get(request_id)
                orphaned = owner is not None and not self.instances[owner].alive
            for key in [k for k in self._events if k[1][1] == mid]:  # reports nobody waited for
                fut = self._events.pop(key)
                if fut.done() and not fut.cancelled():
                    fut.exception()  # retrieved: no "never retrieved" warning for a failure nobody awaited
            if orphaned:  # its instance died while it moved (and the move did not save it)
                self._redispatch(request_id, f"instance {owner} died")
        self._moved_at[request_id] = time.monotonic()
        if reason == "pd":
            self._pd_next[request_id] = time.monotonic() + PD_RETRY_S if result.outcome != "ok" else float("inf")
        self.outcomes[result.outcome] += 1
        self.history.append(result)
        if result.outcome == "ok":
            self.downtime_sum += result.downtime_s
            bucket = next((i for i, b in enumerate(DOWNTIME_BUCKETS) if result.downtime_s <= b), len(DOWNTIME_BUCKETS))
            self.downtime_counts[bucket] += 1
        return result

    def _expect(self, request_id: str, dst: int) -> None:
        """(lock held) A request on its way to `dst` counts in its load until the move is over, so
        moves chosen in the same instant spread out instead of all picking the same instance."""
        progress = self._progress.get(request_id)
        if progress is not None:
            self.instances[dst].incoming[request_id] = blocks_at_full_length(
                len(progress.prompt_token_ids), progress.params.max_new_tokens, self.block_size, self.cp)

    # -- prefill/decode disaggregation ------------------------------------------------------------------
    def _hand_to_decode(self, request_id: str, src: int) -> None:
        """A request has its first token on a prefill instance: move it, KV and all, in one stage,
        to the decode instance with the most room (if none has room, it decodes where it is and
        tries again a little later)."""
        with self._lock:
            progress = self._progress.get(request_id)
            here = self._owner.get(request_id) == src and request_id not in self._moving
            dst = None
            if progress is not None and here:
                dst = self._choose(len(progress.prompt_token_ids), progress.params, ("decode", "mixed"), queued=False)
                if dst is not None and dst != src:
                    self._expect(request_id, dst)  # before the migration task starts: the next choice sees it
        if dst is None or dst == src:
            self._pd_next[request_id] = time.monotonic() + PD_RETRY_S
            return
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
            self._finish_stops()
            if not (draining or due):
                continue
            if due:
                last = time.monotonic()
            try:
                self._rebalance(only_drain=not due)
            except Exception as exc:  # noqa: BLE001 - a bad round must not end the controller
                logger.exception(f"migration controller: {exc}")

    def _rebalance(self, only_drain: bool) -> None:
        now = time.monotonic()
        # prefill instances hand their requests over by rule (above); the controller balances the rest
        live = [c for c in self.instances if c.alive and (c.role != "prefill" or c.draining)]
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

    def _finish_stops(self) -> None:
        """A stopping instance that holds nothing any more is told to stop."""
        for c in self.instances:
            if c.state != "stopping" or c.stop_sent or not c.alive:
                continue
            with self._lock:
                held = any(i == c.index for i in self._owner.values())
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
            moving = dict(self._moving)
            owner = dict(self._owner)
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
            src = self._owner.get(request_id)
            moving = request_id in self._moving
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
                parked, self._parked = self._parked, []
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
            index = self._owner.get(request_id)
            if request_id in self._moving:
                self._aborted.add(request_id)
            if request_id in self._parked:
                self._parked.remove(request_id)
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
                "requests_lost_total": self.requests_lost, "instance_failures_total": self.failures}

    def _num_queued(self) -> int:
        with self._lock:
            open_streams = len(self._streams)
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
            self._owner[request_id] = index
            self._progress[request_id] = Progress(list(prompt_token_ids), params)
        return self.instances[index]

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self.accepting:
            raise QueueFullError(retry_after_s=5.0)
        if self._num_queued() >= self.max_queue:
            raise QueueFullError(retry_after_s=1.0)
        if params.seed is None and params.temperature > 0:
            # drawn here, not by the instance, so a request resumed elsewhere samples what it would have
            params = replace(params, seed=secrets.randbits(52))
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
                self._progress.pop(request_id, None)
                self._pd_next.pop(request_id, None)
                self._recovering.pop(request_id, None)

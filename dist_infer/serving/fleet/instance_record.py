"""One instance and one request as the front end sees them: an instance's connection, last
reported load and life (InstanceClient), what a request's client has been sent (Progress), and
the one record the front end keeps per request (RequestRecord)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Optional, Protocol

from dist_infer.engine.kv_transfer import PeerInstance
from dist_infer.engine.request import RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.serving.fleet.dispatch import InstanceLoad
from dist_infer.serving.fleet.instance_specs import InstanceSpec
from dist_infer.serving.fleet.prefix_index import PrefixIndex
from dist_infer.serving.fleet.wire import Hello, InstanceState, InstanceStats, ResumeProgress, Role, progress_now


@dataclass
class Progress:
    """What a request's client has been sent: enough to resume it on another instance."""

    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)

    def add(self, output: RequestOutput) -> None:
        if output.new_token_ids:
            self.last_token = time.monotonic()
            self.first_token = self.first_token or self.last_token
        self.token_ids += output.new_token_ids
        self.logprobs += output.new_logprobs
        self.top_logprobs += output.new_top_logprobs

    def wire(self) -> ResumeProgress:
        return progress_now(self.token_ids, self.logprobs, self.top_logprobs, self.arrival, self.first_token)


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


class InstanceJob(Protocol):
    """The job the front end started for an instance, as the spawners return it (a local or
    srun subprocess.Popen, a Ray job); some also say their `node`."""

    def poll(self) -> Optional[int]: ...

    def wait(self, timeout: Optional[float] = None) -> int: ...

    def kill(self) -> None: ...


PREFIX_INDEX_PER_BLOCK = 4  # hashes the front end keeps per KV block of an instance (expected ones included)


class InstanceClient:
    """One instance as the front end sees it: its connection, its last reported load, the
    requests sent to it that it has not reported yet, and where it is in its life:
    starting -> serving -> (stopping -> stopped | dead), and from stopped or dead, starting again."""

    def __init__(
        self,
        index: int,
        conn: Optional[Connection] = None,
        hello: Optional[Hello] = None,
        spec: Optional[InstanceSpec] = None,
    ):
        self.index = index
        self.conn: Optional[Connection] = None
        self.hello: Optional[Hello] = None
        if spec is None:  # it joins now (or is about to): its hello says its layout and role
            if hello is None:
                raise TypeError("InstanceClient: give its spec, or the hello of its driver")
            spec = InstanceSpec.of_hello(hello)
        self.spec = spec
        self.state = InstanceState.STARTING
        self.draining = False
        self.dead: Optional[str] = None  # why it died (the last time)
        self.restarts = 0
        self.auto_restarts = 0  # --auto-restart's attempts since it last joined
        self.process: Optional[InstanceJob] = None  # the job this front end started for it (restart, scale-up)
        self.stop_sent = False
        self._lock = threading.Lock()
        self.stats = InstanceStats()  # its last report (all zero: it never joined, its hello is None)
        self.sent = 0
        self.pending: deque[tuple[int, int]] = deque()
        self.incoming: dict[str, int] = {}  # requests migrating here -> their blocks at full length
        self._pending_lock = threading.Lock()
        self.prefix = PrefixIndex(1)  # the block hashes its prefix cache holds (sized when it joins)
        if conn is not None:
            if hello is None:
                raise TypeError("InstanceClient: a connected instance needs its driver's hello")
            self.attach(conn, hello)

    def attach(self, conn: Connection, hello: Hello) -> None:
        """Its driver connected and said hello: it serves from now on (again, after a restart)."""
        self.conn, self.hello = conn, hello
        self.auto_restarts = 0
        self.spec = InstanceSpec.of_hello(hello)
        self.stats = InstanceStats.empty(hello.total_blocks)
        self.sent = 0  # add messages sent (the instance counts those it applied)
        self.pending = deque()  # (add number, blocks its prompt needs)
        self.draining = self.stop_sent = False
        self.prefix = PrefixIndex(PREFIX_INDEX_PER_BLOCK * hello.total_blocks)  # a new process: an empty cache
        self.state = InstanceState.SERVING

    @property
    def alive(self) -> bool:
        return self.state in (InstanceState.SERVING, InstanceState.STOPPING) and self.conn is not None

    @property
    def accepting(self) -> bool:
        return self.state is InstanceState.SERVING and not self.draining

    @property
    def role(self) -> Role:
        return Role(self.spec.role)

    @property
    def total_blocks(self) -> int:
        return self.hello.total_blocks if self.hello else 0

    def peer(self) -> PeerInstance:
        return PeerInstance.from_hello(self.hello)

    def send(self, message: object) -> None:
        """Send one serving/fleet/wire.py message (OSError if it is not connected, or the send fails)."""
        with self._lock:
            if self.conn is None:
                raise OSError(f"instance {self.index} is not connected")
            self.conn.send(message)

    def expect_add(self, blocks: int, prompt_hashes: tuple = ()) -> None:
        """An add is on its way here: its `blocks` (at full length) count in its load, and its
        prompt's hashes in its prefix index, before it reports the request."""
        with self._pending_lock:
            self.sent += 1
            self.pending.append((self.sent, blocks))
        self.prefix.expect(prompt_hashes)

    def load(self, prompt_hashes: tuple = ()) -> InstanceLoad:
        """Its load as dispatch reads it; with a prompt's block hashes, how many of them it holds."""
        s = self.stats
        if self.hello is None:  # never joined
            return InstanceLoad(self.index, 0, 0, accepting=False)
        with self._pending_lock:
            while self.pending and self.pending[0][0] <= s.requests_added:
                self.pending.popleft()
            pending = list(self.pending)
        incoming = dict(self.incoming)
        return InstanceLoad(
            self.index,
            s.free_blocks,
            s.total_blocks,
            s.watermark_blocks,
            s.waiting_demand_blocks,
            s.num_requests_running,
            s.num_requests_waiting,
            len(pending) + len(incoming),
            sum(b for _, b in pending) + sum(incoming.values()),
            accepting=self.accepting,
            running_blocks=tuple(s.running_blocks),
            growth_blocks=s.growth_blocks,
            cached_blocks=self.prefix.matched_blocks(prompt_hashes) if prompt_hashes else 0,
        )

    @property
    def node(self) -> Optional[str]:
        """Where it runs: the Ray node id under --placement ray, else the host its driver reached us from."""
        node = getattr(self.process, "node", None)
        if node is not None:
            return node
        h = self.hello
        return h.addresses[0][0] if h is not None and h.addresses else None

    def describe(self) -> dict:
        """Its /admin/instances entry (plain strings and lists: the JSON is the same as ever)."""
        s, load, h = self.stats, self.load(), self.hello
        return {
            "index": self.index,
            "state": str(self.state),
            "role": str(self.role),
            "layout": self.spec.layout,
            "pids": list(h.pids) if h else [],
            "hosts": [],
            "node": self.node,
            "links": [f"{a[0]}:{a[1]}" for a in (h.addresses if h else ())],
            "load": -load.freeness,
            "freeness": load.freeness,
            "free_blocks": s.free_blocks,
            "total_blocks": s.total_blocks,
            "running": list(s.running_ids),
            "waiting": list(s.waiting_ids),
            "num_preemptions": s.num_preemptions_total,
            "draining": self.draining,
            "dead": self.dead if self.state is InstanceState.DEAD else None,
            "last_failure": self.dead,
            "restarts": self.restarts,
            "cached_blocks": s.cached_blocks,
            "prefix_cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else None,
            "prefix_index_blocks": len(self.prefix),
        }

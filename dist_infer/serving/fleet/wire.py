"""The wire between the front end and each instance's driver: one frozen dataclass per message.

Messages travel pickled over multiprocessing's authenticated connections (serving/fleet/hub.py), so
only a holder of the cluster key ever reaches a pickle. Each end dispatches on the message's
type (`match message:` with class patterns), never on a string tag, so a message's fields are
named once, here. The enums are str-valued: JSON, the admin output and Prometheus labels see the
same strings as before.

    front end -> instance   AddRequest | ResumeRequest | AbortRequest | MigrationCall | StopInstance
    instance -> front end   Hello (first) | StepOutputs | InstanceStats | PrefixEvents | CallReply
                            | MigrationEvent | InstanceDead

A MigrationCall carries one MigrationOp, a dataclass per call of engine/migration.py's endpoint
(StartOut ... CancelIn), or of KV mirroring (serving/fleet/mirror_wire.py); the instance maps each
type to its method (serving/instance/migration_calls.py).

The state a migration carries (MigratingRequest) and its outcomes (MigrationOutcome) are made by
the engine's migration endpoint, below this layer; they are defined there and named here.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Optional

if (
    TYPE_CHECKING
):  # this module loads no torch: serving/fleet/instance_specs.py (and the CLI's parsing) import its enums
    from dist_infer.engine.kv_transfer import PeerInstance
    from dist_infer.engine.migration import MigratingRequest, MigrationOutcome
    from dist_infer.engine.request import RequestOutput
    from dist_infer.engine.sampling import SamplingParams

__all__ = [
    "AbortRequest",
    "AddRequest",
    "CallReply",
    "CancelIn",
    "CommitIn",
    "Hello",
    "InstanceDead",
    "InstanceState",
    "InstanceStats",
    "MigratingRequest",
    "MigrationCall",
    "MigrationEvent",
    "MigrationEventKind",
    "MigrationOp",
    "MigrationOutcome",
    "PauseOut",
    "PrefixEvents",
    "RecvIn",
    "ReleaseOut",
    "ReserveIn",
    "ResumeOut",
    "ResumeProgress",
    "ResumeRequest",
    "Role",
    "SendOut",
    "StartOut",
    "StepOutputs",
    "StopInstance",
]


def __getattr__(name: str):
    """MigratingRequest and MigrationOutcome, named here with the rest of the wire, loaded on first use."""
    if name in ("MigratingRequest", "MigrationOutcome"):
        from dist_infer.engine import migration

        return getattr(migration, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class InstanceState(StrEnum):
    """Where an instance is in its life: starting -> serving -> (stopping -> stopped | dead)."""

    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"


class Role(StrEnum):
    """What an instance takes: prefill instances hand each request to a decode one after its first token."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


# -- front end -> instance ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class ResumeProgress:
    """What a request's client already has, so another instance goes on from there (its instance
    died). Times are ages, not clock readings: the instance may be on another host."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list
    age_s: float
    first_token_age_s: Optional[float] = None


@dataclass(frozen=True)
class ResumeRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    progress: ResumeProgress


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


class MigrationOp:
    """One call of a migration on an instance's driver: a frozen dataclass per method of
    engine/migration.py's MigrationEndpoint, in the order live_migration.py makes them."""

    @property
    def name(self) -> str:
        """The endpoint method's name (start_out, ...), for messages only: nothing dispatches on it."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()


@dataclass(frozen=True)
class StartOut(MigrationOp):
    """Source: begin moving the request out to `peer`; answers {"blocks", "hashes"}."""

    migration_id: int
    request_id: str
    peer: PeerInstance


@dataclass(frozen=True)
class ReserveIn(MigrationOp):
    """Destination: reserve `num_blocks` and claim the prefix it holds of `hashes`; answers the blocks held."""

    migration_id: int
    peer: PeerInstance
    num_blocks: int
    hashes: list[int]


@dataclass(frozen=True)
class SendOut(MigrationOp):
    """Source: send the blocks completed since the last stage; answers (first, count)."""

    migration_id: int
    stage: int
    held: int


@dataclass(frozen=True)
class RecvIn(MigrationOp):
    """Destination: receive a stage's `count` blocks from block `first` on."""

    migration_id: int
    stage: int
    first: int
    count: int


@dataclass(frozen=True)
class PauseOut(MigrationOp):
    """Source: pause the request and send the rest; answers (MigratingRequest, first, count)."""

    migration_id: int
    stage: int
    send_kv: bool
    held: int


@dataclass(frozen=True)
class CommitIn(MigrationOp):
    """Destination: take the request over in `state`."""

    migration_id: int
    state: MigratingRequest


@dataclass(frozen=True)
class ReleaseOut(MigrationOp):
    """Source: the destination has it; free the request's blocks."""

    migration_id: int


@dataclass(frozen=True)
class ResumeOut(MigrationOp):
    """Source: the migration failed; run the request on (if it still runs)."""

    migration_id: int


@dataclass(frozen=True)
class CancelIn(MigrationOp):
    """Destination: the migration failed; free what was reserved (answers "committed" if it was too late)."""

    migration_id: int


@dataclass(frozen=True)
class MigrationCall:
    """One MigrationOp for the driver; answered by a CallReply with its id."""

    call_id: int
    op: MigrationOp


@dataclass(frozen=True)
class StopInstance:
    """Stop serving (the driver's reader ends; the step loop returns)."""


# -- instance -> front end ---------------------------------------------------------------------------
def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"a hello with {what}")


@dataclass(frozen=True)
class Hello:
    """A driver's first message: who it is, its layout, its KV cache and where its ranks' KV links listen."""

    index: int
    tp: int
    pp: int
    total_blocks: int
    block_size: int
    max_positions: int
    vocab_size: int
    layout: str = ""
    role: Role = Role.MIXED
    cp: int = 1
    pids: tuple[int, ...] = ()
    addresses: tuple[tuple, ...] = ()
    block_bytes: int = 0

    @classmethod
    def from_fields(cls, **values: Any) -> "Hello":
        """A checked Hello (lists made tuples, the role an enum); ValueError naming what is wrong."""
        names = {f.name for f in fields(cls)}
        _check(not set(values) - names, f"unknown fields {sorted(set(values) - names)}")
        values["pids"] = tuple(values.get("pids", ()))
        values["addresses"] = tuple(tuple(a) for a in values.get("addresses", ()))
        _check(values.get("role", Role.MIXED) in tuple(Role), f"role {values.get('role')!r}")
        values["role"] = Role(values.get("role", Role.MIXED))
        try:
            hello = cls(**values)
        except TypeError as exc:
            raise ValueError(f"a hello without all its fields ({exc})") from None
        return hello.checked()

    def checked(self) -> "Hello":
        """This hello if its fields have the right types (an unpickled one never ran a constructor)."""
        for name in (
            "index",
            "tp",
            "pp",
            "total_blocks",
            "block_size",
            "max_positions",
            "vocab_size",
            "cp",
            "block_bytes",
        ):
            value = getattr(self, name, None)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"{name} {value!r}")
        _check(self.tp >= 1 and self.pp >= 1, f"layout tp {self.tp} pp {self.pp}")
        _check(self.role in tuple(Role), f"role {self.role!r}")
        _check(isinstance(self.addresses, tuple) and isinstance(self.pids, tuple), "pids or addresses not tuples")
        return self


@dataclass(frozen=True)
class PrefixEvents:
    """The block hashes an instance's prefix cache stored and evicted in its last steps (batched
    per step; the front end's prefix index, serving/fleet/prefix_index.py, reads them)."""

    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[RequestOutput]


@dataclass(frozen=True)
class InstanceStats:
    """An instance's load after a step: the one definition of its keys and their defaults (the
    engine's `stats()` dict is read through `from_dict`; metrics read `as_dict()`)."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    cached_blocks: int = 0  # blocks holding cached prefixes nobody uses now (counted in free_blocks)
    free_blocks: int = 0
    total_blocks: int = 0
    watermark_blocks: int = 0
    waiting_demand_blocks: int = 0
    growth_blocks: int = 0
    running_ids: tuple[str, ...] = ()
    waiting_ids: tuple[str, ...] = ()
    running_blocks: tuple[int, ...] = ()
    requests_added: int = 0
    step_seconds: Optional[dict] = None  # {kind: (bucket bounds, counts, sum)}: the engine's step times
    prefill_backlog_s: Optional[float] = None  # predicted seconds of the prompts queued (engine/step_cost.py)
    structured: Optional[dict] = None  # structured outputs' counters (engine/structured/counters.py)
    speculative: Optional[dict] = None  # speculative decoding's counters (engine/speculative/counters.py)
    kv_mirror: Optional[dict] = None  # KV mirroring's counters, source and buddy sides (engine/mirror/)

    @classmethod
    def from_dict(cls, stats: dict) -> "InstanceStats":
        """From the engine's stats(): keys it leaves out take their defaults, sequences become tuples."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in stats.items() if k in known}
        return cls(**values)

    @classmethod
    def empty(cls, total_blocks: int) -> "InstanceStats":
        """What the front end assumes of an instance that just joined, until it reports."""
        return cls(free_blocks=total_blocks, total_blocks=total_blocks)

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class CallReply:
    """A MigrationCall's answer: ok and its value, or not ok and (outcome, message)."""

    call_id: int
    ok: bool
    value: Any


class MigrationEventKind(StrEnum):
    """What an instance reports of a migration's stage (engine/migration.py's `notify`)."""

    STAGE_DONE = "stage_done"  # its transfers of the stage are out (sent, or received) on this instance
    STAGE_FAILED = "stage_failed"  # a transfer of the stage failed


@dataclass(frozen=True)
class MigrationEvent:
    """A migration's stage is out on this instance, or failed."""

    kind: MigrationEventKind
    migration_id: int
    stage: int


@dataclass(frozen=True)
class InstanceDead:
    reason: str


def progress_now(
    token_ids: list[int], logprobs: list[float], top_logprobs: list, arrival: float, first_token: Optional[float]
) -> ResumeProgress:
    """A ResumeProgress from the front end's clock readings (monotonic) as ages."""
    now = time.monotonic()
    return ResumeProgress(
        list(token_ids),
        list(logprobs),
        list(top_logprobs),
        now - arrival,
        None if first_token is None else now - first_token,
    )

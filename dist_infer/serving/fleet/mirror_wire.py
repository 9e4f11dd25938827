"""The calls of KV mirroring on an instance's driver (engine/mirror/), one frozen dataclass each,
sent in a MigrationCall like a migration's (serving/fleet/wire.py) and answered by a CallReply.

    source   MirrorOffer -> [MirrorEntry]    MirrorSend -> blocks queued    MirrorDone
    buddy    MirrorReserve -> [MirrorAnswer]  MirrorCommit  (MirrorCancel on any failure)
    buddy    MirrorRelease: end leases (the request ended, moved, or runs here now)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from dist_infer.serving.fleet.wire import MigrationOp

if TYPE_CHECKING:  # no torch here: the CLI's parsing imports the wire
    from dist_infer.engine.kv_transfer import PeerInstance
    from dist_infer.engine.mirror.entries import MirrorAnswer, MirrorEntry


@dataclass(frozen=True)
class MirrorOffer(MigrationOp):
    """Source: name (and hold) up to `max_blocks` full blocks `buddy` lacks; answers [MirrorEntry]."""

    migration_id: int
    buddy: PeerInstance
    max_blocks: int


@dataclass(frozen=True)
class MirrorReserve(MigrationOp):
    """Buddy: take what `entries` bring within `fraction` of the cache; answers [MirrorAnswer]."""

    migration_id: int
    source: PeerInstance
    entries: tuple[MirrorEntry, ...]
    fraction: float


@dataclass(frozen=True)
class MirrorSend(MigrationOp):
    """Source: send the blocks the buddy's answers ask for; answers how many."""

    migration_id: int
    answers: tuple[MirrorAnswer, ...]
    buddy: PeerInstance


@dataclass(frozen=True)
class MirrorCommit(MigrationOp):
    """Buddy: every rank has the round's blocks; cache and lease them."""

    migration_id: int


@dataclass(frozen=True)
class MirrorCancel(MigrationOp):
    """Buddy: the round failed; free what it reserved."""

    migration_id: int


@dataclass(frozen=True)
class MirrorDone(MigrationOp):
    """Source: the round is over (`committed` or not); let go of the blocks it held."""

    migration_id: int
    committed: bool


@dataclass(frozen=True)
class MirrorRelease(MigrationOp):
    """Buddy: end the leases of these requests of instance `source` (None: all of its)."""

    source: int
    request_ids: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class MirrorForget(MigrationOp):
    """Source: the buddy is gone or mirroring stopped; nothing of ours is mirrored anywhere."""


MIRROR_OPS = (
    MirrorOffer,
    MirrorReserve,
    MirrorSend,
    MirrorCommit,
    MirrorCancel,
    MirrorDone,
    MirrorRelease,
    MirrorForget,
)

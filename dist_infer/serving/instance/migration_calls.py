"""An instance's side of the migration calls: each MigrationOp type of serving/fleet/wire.py runs
its own method of engine/migration.py's MigrationEndpoint. The dispatch is on the op's type, so
nothing the front end sends names a method to look up."""

from __future__ import annotations

from typing import Callable

from dist_infer.serving.fleet.mirror_wire import (
    MirrorCancel,
    MirrorCommit,
    MirrorDone,
    MirrorForget,
    MirrorOffer,
    MirrorRelease,
    MirrorReserve,
    MirrorSend,
)
from dist_infer.serving.fleet.wire import (
    CancelIn,
    CommitIn,
    MigrationOp,
    PauseOut,
    RecvIn,
    ReleaseOut,
    ReserveIn,
    ResumeOut,
    SendOut,
    StartOut,
)

Reply = Callable[[object], None]


def run_migration_op(endpoint, op: MigrationOp, reply: Reply) -> None:
    """Call `endpoint`'s method for `op`, which answers through `reply`; TypeError for anything
    that is not one of the migration calls."""
    match op:
        case StartOut():
            endpoint.start_out(op.migration_id, op.request_id, op.peer, reply=reply)
        case ReserveIn():
            endpoint.reserve_in(op.migration_id, op.peer, op.num_blocks, op.hashes, reply=reply)
        case SendOut():
            endpoint.send_out(op.migration_id, op.stage, op.held, reply=reply)
        case RecvIn():
            endpoint.recv_in(op.migration_id, op.stage, op.first, op.count, reply=reply)
        case PauseOut():
            endpoint.pause_out(op.migration_id, op.stage, op.send_kv, op.held, reply=reply)
        case CommitIn():
            endpoint.commit_in(op.migration_id, op.state, reply=reply)
        case ReleaseOut():
            endpoint.release_out(op.migration_id, reply=reply)
        case ResumeOut():
            endpoint.resume_out(op.migration_id, reply=reply)
        case CancelIn():
            endpoint.cancel_in(op.migration_id, reply=reply)
        case _:
            run_mirror_op(endpoint, op, reply)


def run_mirror_op(endpoint, op: MigrationOp, reply: Reply) -> None:
    """The mirroring calls (serving/fleet/mirror_wire.py): the endpoint's mirror_out (source) and
    mirror_in (buddy) sides."""
    source, store = endpoint.mirror_out, endpoint.mirror_in
    match op:
        case MirrorOffer():
            source.offer(op.migration_id, op.buddy, op.max_blocks, reply)
        case MirrorSend():
            source.send(op.migration_id, op.answers, op.buddy, reply)
        case MirrorDone():
            source.done(op.migration_id, op.committed, reply)
        case MirrorForget():
            source.forget_buddy()
            reply(True)
        case MirrorReserve():
            store.reserve(op.migration_id, op.source, op.entries, op.fraction, reply)
        case MirrorCommit():
            store.commit(op.migration_id, reply)
        case MirrorCancel():
            store.cancel(op.migration_id, reply)
        case MirrorRelease():
            reply(store.release(op.source, op.request_ids))
        case _:
            raise TypeError(f"{type(op).__name__} is not a migration call")

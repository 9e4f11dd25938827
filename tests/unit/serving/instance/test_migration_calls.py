"""The migration calls on an instance's side are typed: each MigrationOp of the wire runs its own
endpoint method with its fields (serving/instance/migration_calls.py), the driver answers a call
it cannot take with an error reply instead of looking a name up, and the stage reports leave it
as a MigrationEventKind."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from dist_infer.engine.kv_transfer import PeerInstance
from dist_infer.engine.migration import MigrationAborted, MigrationOutcome
from dist_infer.engine.mirror import MirrorAnswer, MirrorEntry
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
    CallReply,
    CancelIn,
    CommitIn,
    MigrationCall,
    MigrationEvent,
    MigrationEventKind,
    PauseOut,
    RecvIn,
    ReleaseOut,
    ReserveIn,
    ResumeOut,
    SendOut,
    StartOut,
)
from dist_infer.serving.instance.driver_loop import InstanceServer
from dist_infer.serving.instance.migration_calls import run_migration_op

PEER = PeerInstance(1, 1, 1, (("127.0.0.1", 1001),))


class RecordingEndpoint:
    """Every MigrationEndpoint method, recording (name, args) and answering with its name."""

    def __init__(self):
        self.seen: list[tuple] = []

    def __getattr__(self, name: str):
        def method(*args, reply):
            self.seen.append((name, args))
            reply(name)

        return method


OPS = [
    (StartOut(7, "r", PEER), ("start_out", (7, "r", PEER))),
    (ReserveIn(7, PEER, 5, [11, 12]), ("reserve_in", (7, PEER, 5, [11, 12]))),
    (SendOut(7, 0, 2), ("send_out", (7, 0, 2))),
    (RecvIn(7, 0, 2, 3), ("recv_in", (7, 0, 2, 3))),
    (PauseOut(7, 1, False, 2), ("pause_out", (7, 1, False, 2))),
    (CommitIn(7, "state"), ("commit_in", (7, "state"))),
    (ReleaseOut(7), ("release_out", (7,))),
    (ResumeOut(7), ("resume_out", (7,))),
    (CancelIn(7), ("cancel_in", (7,))),
]
ENTRIES = (MirrorEntry("r", 2, (11, 12)),)
ANSWERS = (MirrorAnswer((True, False), 4),)
MIRROR_OPS = [
    (MirrorOffer(7, PEER, 64), ("mirror_out", "offer", (7, PEER, 64))),
    (MirrorSend(7, ANSWERS, PEER), ("mirror_out", "send", (7, ANSWERS, PEER))),
    (MirrorDone(7, True), ("mirror_out", "done", (7, True))),
    (MirrorReserve(7, PEER, ENTRIES, 0.5), ("mirror_in", "reserve", (7, PEER, ENTRIES, 0.5))),
    (MirrorCommit(7), ("mirror_in", "commit", (7,))),
    (MirrorCancel(7), ("mirror_in", "cancel", (7,))),
]


class RecordingMirror:
    """One side of the mirror: records (side, method, args) and answers with the method's name."""

    def __init__(self, side: str, seen: list):
        self.side, self.seen = side, seen

    def __getattr__(self, name: str):
        def method(*args):
            *args, reply = args
            self.seen.append((self.side, name, tuple(args)))
            reply(name)

        return method

    def forget_buddy(self):
        self.seen.append((self.side, "forget_buddy", ()))

    def release(self, source, request_ids):
        self.seen.append((self.side, "release", (source, request_ids)))
        return 1


@pytest.mark.parametrize("op, expected", MIRROR_OPS, ids=[type(op).__name__ for op, _ in MIRROR_OPS])
def test_each_mirror_op_runs_its_side_s_method_with_its_fields(op, expected):
    seen: list = []
    endpoint = SimpleNamespace(
        mirror_out=RecordingMirror("mirror_out", seen), mirror_in=RecordingMirror("mirror_in", seen)
    )
    replies: list = []
    run_migration_op(endpoint, pickle.loads(pickle.dumps(op)), replies.append)
    assert seen == [expected] and replies == [expected[1]]


def test_release_and_forget_answer_at_once():
    seen: list = []
    endpoint = SimpleNamespace(
        mirror_out=RecordingMirror("mirror_out", seen), mirror_in=RecordingMirror("mirror_in", seen)
    )
    replies: list = []
    run_migration_op(endpoint, MirrorRelease(3, ("a",)), replies.append)
    run_migration_op(endpoint, MirrorForget(), replies.append)
    assert seen == [("mirror_in", "release", (3, ("a",))), ("mirror_out", "forget_buddy", ())]
    assert replies == [1, True]


@pytest.mark.parametrize("op, expected", OPS, ids=[type(op).__name__ for op, _ in OPS])
def test_each_op_runs_its_own_method_with_its_fields(op, expected):
    endpoint, replies = RecordingEndpoint(), []
    run_migration_op(endpoint, pickle.loads(pickle.dumps(op)), replies.append)  # as it crosses the wire
    assert endpoint.seen == [expected] and replies == [expected[0]]
    assert op.name == expected[0], "messages name the call as the endpoint does"


def test_anything_else_is_refused_without_a_lookup():
    endpoint = RecordingEndpoint()
    for bad in ("start_out", ("start_out", 7), SimpleNamespace(migration_id=7)):
        with pytest.raises(TypeError, match="is not a migration call"):
            run_migration_op(endpoint, bad, print)
    assert endpoint.seen == []


class FakeConn:
    def __init__(self):
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)


def _server(migration) -> tuple[InstanceServer, FakeConn]:
    engine = SimpleNamespace(migration=migration, call_soon=lambda fn: fn(), wake=lambda: None)
    conn = FakeConn()
    return InstanceServer(engine, 3, conn), conn


def test_the_driver_answers_each_call_by_its_id():
    endpoint = RecordingEndpoint()
    server, conn = _server(endpoint)
    server._call(41, SendOut(7, 0, 0))
    assert conn.sent == [CallReply(41, True, "send_out")] and endpoint.seen == [("send_out", (7, 0, 0))]


def test_the_driver_refuses_a_method_name_and_a_call_it_cannot_take():
    endpoint = RecordingEndpoint()
    server, conn = _server(endpoint)
    server._call(1, "start_out")  # the old wire's shape: a name to look up
    server._call(2, MigrationCall(3, StartOut(7, "r", PEER)))  # not an op either
    assert endpoint.seen == []
    assert [(r.call_id, r.ok, r.value[0]) for r in conn.sent] == [
        (1, False, MigrationOutcome.ERROR),
        (2, False, MigrationOutcome.ERROR),
    ]
    assert "takes no call 'str'" in conn.sent[0].value[1] and "'MigrationCall'" in conn.sent[1].value[1]
    cp, cp_conn = _server(None)  # a context-parallel instance has no migration endpoint
    cp._call(5, StartOut(7, "r", PEER))
    assert cp_conn.sent[0].ok is False and "takes no call 'start_out'" in cp_conn.sent[0].value[1]


def test_the_driver_passes_a_refusal_of_the_endpoint_on():
    class Refusing:
        def start_out(self, mid, request_id, peer, reply):
            raise MigrationAborted(MigrationOutcome.SOURCE_ENDED, f"{request_id} ended")

    server, conn = _server(Refusing())
    server._call(9, StartOut(7, "r", PEER))
    assert conn.sent == [CallReply(9, False, (MigrationOutcome.SOURCE_ENDED, "r ended"))]


def test_stage_reports_are_typed_on_the_wire():
    server, conn = _server(RecordingEndpoint())
    server._notify("stage_done", 7, 0)
    server._notify("stage_failed", 7, 1)
    assert conn.sent == [
        MigrationEvent(MigrationEventKind.STAGE_DONE, 7, 0),
        MigrationEvent(MigrationEventKind.STAGE_FAILED, 7, 1),
    ]
    assert conn.sent[0].kind == "stage_done", "the enum's values are the strings the engine reports"
    with pytest.raises(ValueError):
        server._notify("stage_started", 7, 0)

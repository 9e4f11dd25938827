"""One live migration through the front end (Cluster, InstanceCalls, live_migration.py) against
two fake instance drivers over pipes (no processes): the typed calls each side gets, in order;
the stage reports that settle the waits; the client's stream going on from the destination (or,
when a stage fails, from the source after the undo); and nothing held afterwards."""

from __future__ import annotations

import asyncio
import threading
from multiprocessing import Pipe

from dist_infer.engine.request import RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.serving.fleet.cluster import Cluster, FleetConfig, InstanceClient
from dist_infer.serving.fleet.wire import (
    AddRequest,
    CallReply,
    CommitIn,
    Hello,
    MigrationCall,
    MigrationEvent,
    MigrationEventKind,
    PauseOut,
    RecvIn,
    ReserveIn,
    ResumeOut,
    SendOut,
    StartOut,
    StepOutputs,
    StopInstance,
)
from tests.support.polling import wait_until

BLOCK_BYTES = 1024


def _hello(index: int) -> Hello:
    return Hello.from_fields(
        index=index,
        tp=1,
        pp=1,
        role="mixed",
        total_blocks=64,
        block_size=4,
        max_positions=256,
        vocab_size=100,
        block_bytes=BLOCK_BYTES,
        cp=1,
        pids=[],
        addresses=[["127.0.0.1", 1]],
    )


def _output(request_id: str, token: int, finished: bool) -> RequestOutput:
    return RequestOutput(request_id, [token], [0.0], [], "", finished, "length" if finished else None)


class MigratingDriver:
    """Streams token 1 of each request and holds it; answers the migration calls as an endpoint
    would (2 blocks per copy stage, 1 at the pause), reporting each stage out, or, with
    `fail_recv`, its receive failed. Whoever ends up with the request (the destination on
    commit, the source on resume) streams its last token, 2."""

    def __init__(self, index: int, fail_recv: bool = False):
        self.index, self.fail_recv = index, fail_recv
        self.api_end, self.end = Pipe()
        self.ops: list[str] = []
        self.request_id = ""
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                message = self.end.recv()
            except (EOFError, OSError):
                return
            match message:
                case AddRequest(request_id=request_id):
                    self.request_id = request_id
                    self.end.send(StepOutputs([_output(request_id, 1, False)]))
                case MigrationCall(call_id=call_id, op=op):
                    self.ops.append(type(op).__name__)
                    self._answer(call_id, op)
                case StopInstance():
                    self.end.close()
                    return

    def _stage(self, op, failed: bool = False) -> None:
        kind = MigrationEventKind.STAGE_FAILED if failed else MigrationEventKind.STAGE_DONE
        self.end.send(MigrationEvent(kind, op.migration_id, op.stage))

    def _answer(self, call_id: int, op) -> None:
        value = None
        match op:
            case StartOut(request_id=request_id):
                self.request_id, value = request_id, {"blocks": 3, "hashes": []}
            case ReserveIn():
                value = 0
            case SendOut():
                self._stage(op)  # before its answer: a report may come before anyone waits for it
                value = (0, 2)
            case PauseOut():
                value = (self.request_id, 2, 1)  # its state: here its id, which the commit carries over
            case CommitIn(state=request_id):
                self.request_id = request_id
        self.end.send(CallReply(call_id, True, value))
        match op:
            case RecvIn():
                self._stage(op, failed=self.fail_recv)
            case CommitIn() | ResumeOut():
                self.end.send(StepOutputs([_output(self.request_id, 2, True)]))


def _cluster(fail_recv: bool) -> tuple[Cluster, list[MigratingDriver]]:
    drivers = [MigratingDriver(0), MigratingDriver(1, fail_recv=fail_recv)]
    clients = [InstanceClient(i, d.api_end, _hello(i)) for i, d in enumerate(drivers)]
    cluster = Cluster(clients, "fake", config=FleetConfig(migrate_interval=0, dispatch="rr", migration_timeout=10.0))
    cluster.start()
    return cluster, drivers


async def _migrate_midstream(cluster: Cluster):
    stream = cluster.generate("r", [5, 6, 7], SamplingParams(max_new_tokens=4))
    tokens = (await stream.__anext__()).new_token_ids
    result = await asyncio.wrap_future(cluster.migrate_now("r", 1))
    async for output in stream:
        tokens += output.new_token_ids
    return tokens, result


def test_a_live_migration_makes_its_calls_in_order_and_the_stream_goes_on_from_the_destination():
    cluster, (src, dst) = _cluster(fail_recv=False)
    try:
        tokens, result = asyncio.run(asyncio.wait_for(_migrate_midstream(cluster), 30))
        assert tokens == [1, 2]
        assert (result.outcome, result.src, result.dst, result.stages, result.blocks) == ("ok", 0, 1, 2, 3)
        assert result.bytes == 3 * BLOCK_BYTES and result.downtime_s > 0
        assert src.ops == ["StartOut", "SendOut", "PauseOut", "ReleaseOut"]
        assert dst.ops == ["ReserveIn", "RecvIn", "RecvIn", "CommitIn"]
        assert cluster.stats()["migrations_total"] == {"ok": 1}
        wait_until(lambda: not any(cluster.held().values()), 5.0, lambda: f"entries held: {cluster.held()}")
    finally:
        cluster.stop(timeout=5)


def test_a_failed_stage_is_undone_on_both_sides_and_the_source_runs_on():
    cluster, (src, dst) = _cluster(fail_recv=True)
    try:
        tokens, result = asyncio.run(asyncio.wait_for(_migrate_midstream(cluster), 30))
        assert tokens == [1, 2], "the source resumed it and finished it"
        assert result.outcome == "transfer_failed" and "stage 0 failed" in result.message
        assert src.ops == ["StartOut", "SendOut", "ResumeOut"]
        assert dst.ops == ["ReserveIn", "RecvIn", "CancelIn"]
        assert cluster.stats()["migrations_total"] == {"transfer_failed": 1}
        wait_until(lambda: not any(cluster.held().values()), 5.0, lambda: f"entries held: {cluster.held()}")
    finally:
        cluster.stop(timeout=5)

"""The calls a migration makes on instances' drivers: each call is a MigrationOp sent in a
MigrationCall on the instance's connection and answered by a CallReply with its id, and each
stage of a transfer is a MigrationEvent the instance reports. Runs on the control loop; its
state (call ids, the futures waiting for replies and stage reports, the migrations in flight) is
its own."""

from __future__ import annotations

import asyncio
import itertools
import time

from dist_infer.engine.kv_transfer import PeerInstance
from dist_infer.engine.migration import MigrationAborted, MigrationOutcome
from dist_infer.serving.fleet.control_loop import ControlLoop
from dist_infer.serving.fleet.fleet_state import FleetState
from dist_infer.serving.fleet.instance_record import InstanceClient
from dist_infer.serving.fleet.wire import CallReply, MigrationCall, MigrationEvent, MigrationEventKind, MigrationOp

STAGE_DONE = MigrationEventKind.STAGE_DONE


class InstanceCalls:
    """The front end's RPC to the instances' drivers."""

    def __init__(self, fleet: FleetState, control: ControlLoop):
        self.fleet, self.control = fleet, control
        self._ids = itertools.count(1)  # call ids (each answered on its own instance's connection)
        self._calls: dict[int, tuple[asyncio.Future, int]] = {}  # call id -> (its reply, the instance)
        self._stages: dict[tuple[int, int, int], asyncio.Future] = {}  # (instance, migration, stage) -> its report
        self._migrations: set[int] = set()  # in flight: random ids, so no one can guess the next one's KV keys

    def peer(self, index: int) -> PeerInstance:
        return self.fleet.instances[index].peer()

    async def call(self, index: int, op: MigrationOp, timeout: float, failure: str = MigrationOutcome.SOURCE_FAILED):
        """Run `op` on instance `index`'s driver and give its answer; MigrationAborted(`failure`) if
        it does not answer within `timeout` or is dead."""
        client = self.fleet.instances[index]
        if not client.alive:
            raise MigrationAborted(failure, f"instance {index} is {client.state}: {client.dead or ''}")
        call_id = next(self._ids)
        fut = self.control.create_future()
        self._calls[call_id] = (fut, index)
        try:
            client.send(MigrationCall(call_id, op))
            return await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, OSError) as exc:
            raise MigrationAborted(
                failure, f"instance {index} did not answer {op.name} within {timeout:g} s ({type(exc).__name__})"
            ) from None
        except MigrationAborted as exc:
            if exc.outcome == MigrationOutcome.INSTANCE_DIED:
                raise MigrationAborted(failure, str(exc)) from None
            raise
        finally:
            self._calls.pop(call_id, None)

    async def wait_stage(
        self, index: int, migration_id: int, stage: int, timeout: float, failure: str, watch: tuple[int, ...] = ()
    ) -> None:
        """Wait for instance `index` to report the stage out (it may have already);
        MigrationAborted(`failure`) if it does not within `timeout`, or it (or an instance in
        `watch`) dies, or it reports the stage failed."""
        key = (index, migration_id, stage)
        fut = self._stages.setdefault(key, self.control.create_future())
        deadline = time.monotonic() + timeout
        try:
            while not fut.done():
                gone = [i for i in (index, *watch) if not self.fleet.instances[i].alive]
                if gone or time.monotonic() > deadline:
                    why = f"instance {gone[0]} is {self.fleet.instances[gone[0]].state}" if gone else "alive"
                    raise MigrationAborted(
                        failure
                        if not gone or gone[0] == index
                        else (
                            MigrationOutcome.SOURCE_FAILED
                            if failure == MigrationOutcome.DEST_FAILED
                            else MigrationOutcome.DEST_FAILED
                        ),
                        f"instance {index} did not report {STAGE_DONE} of migration {migration_id} "
                        f"stage {stage} within {timeout:g} s ({why})",
                    )
                await asyncio.wait([fut], timeout=0.05)
            fut.result()  # raises MigrationAborted if the instance reported the stage failed
        finally:
            self._stages.pop(key, None)

    def on_message(self, client: InstanceClient, message: CallReply | MigrationEvent) -> None:
        """(control loop) A call's reply settles its future; a stage's report settles its wait."""
        match message:
            case CallReply():
                self._on_reply(message)
            case MigrationEvent():
                self._on_event(client, message)

    def _on_reply(self, reply: CallReply) -> None:
        entry = self._calls.pop(reply.call_id, None)
        if entry is None or entry[0].done():
            return
        if reply.ok:
            entry[0].set_result(reply.value)
        else:
            entry[0].set_exception(MigrationAborted(*reply.value))

    def _on_event(self, client: InstanceClient, event: MigrationEvent) -> None:
        if event.migration_id not in self._migrations:
            return  # a report of a migration that is over: nobody waits for it, nothing is kept
        fut = self._stages.setdefault((client.index, event.migration_id, event.stage), self.control.create_future())
        if fut.done():
            return
        if event.kind == MigrationEventKind.STAGE_FAILED:  # it answers the wait for that stage
            fut.set_exception(
                MigrationAborted(
                    MigrationOutcome.TRANSFER_FAILED,
                    f"instance {client.index}: a KV transfer of migration "
                    f"{event.migration_id} stage {event.stage} failed",
                )
            )
        else:
            fut.set_result(True)

    def fail_calls(self, index: int) -> None:
        """(control loop) Instance `index` is gone: the calls waiting on it fail."""
        for call_id, (fut, inst) in list(self._calls.items()):
            if inst == index and not fut.done():
                fut.set_exception(MigrationAborted(MigrationOutcome.INSTANCE_DIED, f"instance {index} died"))

    def open_migration(self, migration_id: int) -> None:
        """From now on the instances' reports of this migration's stages are kept for its waits."""
        self._migrations.add(migration_id)

    def close_migration(self, migration_id: int) -> None:
        """The migration is over: its reports nobody waited for are dropped, later ones ignored."""
        self._migrations.discard(migration_id)
        for key in [k for k in self._stages if k[1] == migration_id]:
            fut = self._stages.pop(key)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: no "never retrieved" warning for a failure nobody awaited

    def held(self) -> dict[str, int]:
        """What it holds for calls and migrations in flight (all 0 when idle)."""
        return {"calls": len(self._calls), "events": len(self._stages), "migrations": len(self._migrations)}

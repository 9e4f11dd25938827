"""The calls a migration makes on instances' drivers (Cluster's part that waits on them): each
call is a message on the instance's connection answered by a reply with its id, and each stage
of a transfer is an event the instance reports. Runs on the cluster's control loop."""

from __future__ import annotations

import asyncio
import time

from dist_infer.engine.kv_transfer import PeerInstance
from dist_infer.engine.migration import MigrationAborted, MigrationOutcome
from dist_infer.serving.fleet.instance_record import InstanceClient
from dist_infer.serving.fleet.wire import CallReply, MigrationCall, MigrationEvent


class InstanceCalls:
    """Cluster's RPC to the instances' drivers (state: _calls, _events, _active_migrations)."""

    def peer(self, index: int) -> PeerInstance:
        return self.instances[index].peer()

    async def call(self, index: int, method: str, *args, timeout: float, failure: str = MigrationOutcome.SOURCE_FAILED):
        """Call a migration method on instance `index`'s driver; MigrationAborted(`failure`) if it
        does not answer within `timeout` or is dead."""
        client = self.instances[index]
        if not client.alive:
            raise MigrationAborted(failure, f"instance {index} is {client.state}: {client.dead or ''}")
        call_id = next(self._ids)
        fut = self.loop.create_future()
        self._calls[call_id] = (fut, index)
        try:
            client.send(MigrationCall(call_id, method, args))
            return await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, OSError) as exc:
            raise MigrationAborted(failure, f"instance {index} did not answer {method} within {timeout:g} s "
                                            f"({type(exc).__name__})") from None
        except MigrationAborted as exc:
            if exc.outcome == MigrationOutcome.INSTANCE_DIED:
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
                                           (MigrationOutcome.SOURCE_FAILED if failure == MigrationOutcome.DEST_FAILED
                                            else MigrationOutcome.DEST_FAILED),
                                           f"instance {index} did not report {event[0]} of migration {event[1]} "
                                           f"stage {event[2]} within {timeout:g} s ({why})")
                await asyncio.wait([fut], timeout=0.05)
            fut.result()  # raises MigrationAborted if the instance reported the stage failed
        finally:
            self._events.pop(key, None)

    def _on_control(self, client: InstanceClient, message: CallReply | MigrationEvent) -> None:
        """(control loop) A call's reply settles its future; a stage's event settles its wait."""
        match message:
            case CallReply():
                self._on_reply(message)
            case MigrationEvent(name=name, args=args):
                self._on_event(client, name, args)

    def _on_reply(self, reply: CallReply) -> None:
        entry = self._calls.pop(reply.call_id, None)
        if entry is None or entry[0].done():
            return
        if reply.ok:
            entry[0].set_result(reply.value)
        else:
            entry[0].set_exception(MigrationAborted(*reply.value))

    def _on_event(self, client: InstanceClient, name: str, args: tuple) -> None:
        if not args or args[0] not in self._active_migrations:
            return  # a report of a migration that is over: nobody waits for it, nothing is kept
        failed = name == "stage_failed"  # it answers the wait for that stage's stage_done
        key = (client.index, ("stage_done" if failed else name, *args))
        fut = self._events.setdefault(key, self.loop.create_future())
        if fut.done():
            return
        if failed:
            fut.set_exception(MigrationAborted(MigrationOutcome.TRANSFER_FAILED, f"instance {client.index}: a KV "
                                               f"transfer of migration {args[0]} stage {args[1]} failed"))
        else:
            fut.set_result(True)

    def _fail_calls(self, index: int) -> None:
        for call_id, (fut, inst) in list(self._calls.items()):
            if inst == index and not fut.done():
                fut.set_exception(MigrationAborted(MigrationOutcome.INSTANCE_DIED, f"instance {index} died"))

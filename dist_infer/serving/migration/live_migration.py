"""One live migration, driven from the front end: reserve, copy in stages, pause, commit.

As in Llumnix, the request keeps decoding on the source while its KV blocks are copied to the
destination in stages, each stage carrying the blocks completed since the last; when few are
left (or after MAX_STAGES) the source pauses the request, sends the rest, and the destination
takes it over. Downtime is the last stage alone, so it stays flat as the context grows. The
destination claims the leading blocks its prefix cache already holds when it reserves, and the
source sends only the blocks after them.

Every step is a call on one instance's driver (engine/migration.py) that answers or raises
MigrationAborted; every failure undoes what was done: the destination's reserved blocks are
freed, the source resumes (or keeps, or has ended) the request. Nothing is left half-moved.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Optional

from loguru import logger

from dist_infer.engine.migration import MigrationAborted, MigrationOutcome
from dist_infer.serving.fleet.fleet_state import FleetState
from dist_infer.serving.fleet.instance_calls import InstanceCalls
from dist_infer.serving.fleet.wire import (
    CancelIn,
    CommitIn,
    PauseOut,
    RecvIn,
    ReleaseOut,
    ReserveIn,
    ResumeOut,
    SendOut,
    StartOut,
)

MAX_STAGES = 4  # copy stages while the request runs; then it pauses for the last one
FEW_BLOCKS = 2  # when at most this many new blocks are left, pause now
SOURCE_FAILED, DEST_FAILED = MigrationOutcome.SOURCE_FAILED, MigrationOutcome.DEST_FAILED  # whose side failed
CALL_TIMEOUT_S = 30.0  # an instance that does not answer a migration call in this long has failed it


@dataclass
class MigrationResult:
    request_id: str
    src: int
    dst: int
    reason: str
    outcome: MigrationOutcome  # ok, or why it did not happen: no_room, source_ended, source_preempted, ...
    message: str = ""
    downtime_s: float = 0.0
    total_s: float = 0.0
    stages: int = 0
    blocks: int = 0  # blocks sent
    held_blocks: int = 0  # leading blocks the destination's prefix cache had already: not sent
    bytes: int = 0
    phases_ms: Optional[dict] = None  # pause (waits for the source's current step), transfer of the rest, commit

    def as_dict(self) -> dict:
        return dict(self.__dict__)


MODES = ("live", "recompute")
Moved = Callable[[str, int, int], None]  # (request id, src, dst): the destination has it; stream from there


@dataclass(frozen=True)
class MigrationOrder:
    """One migration to make. mode 'recompute': no KV moves; the destination prefills the
    request's tokens again. `max_stages` 0: pause at once and send everything in one stage
    (prefill -> decode hand-over)."""

    migration_id: int
    request_id: str
    src: int
    dst: int
    reason: str
    mode: str = "live"
    max_stages: int = MAX_STAGES


async def migrate(
    calls: InstanceCalls, fleet: FleetState, order: MigrationOrder, on_moved: Moved, timeout: float = CALL_TIMEOUT_S
) -> MigrationResult:
    """Make `order` through `calls` (the instances' drivers); `on_moved` once the destination has
    the request, before the source lets go of it."""
    mid, request_id, src, dst = order.migration_id, order.request_id, order.src, order.dst
    result = MigrationResult(request_id, src, dst, order.reason, MigrationOutcome.OK)
    started = time.perf_counter()

    def stage_done(inst: int, stage: int):
        return calls.wait_stage(
            inst, mid, stage, timeout, SOURCE_FAILED if inst == src else DEST_FAILED, watch=(src, dst)
        )

    reserved = committing = False
    pause_at = paused_at = posted_at = 0.0
    stage = sent = held = 0
    phases: dict[str, float] = {}  # ms of each phase, once it has moved
    try:
        info = await calls.call(src, StartOut(mid, request_id, calls.peer(dst)), timeout)
        reserved = True  # from here on a failure cancels on the destination (a no-op if it reserved nothing;
        # a reserve that answers too late is undone by the cancel queued behind it)
        live = order.mode == "live"
        held = await calls.call(
            dst,
            ReserveIn(mid, calls.peer(src), info["blocks"] + FEW_BLOCKS if live else 0, info.get("hashes", [])),
            timeout,
            DEST_FAILED,
        )
        while live and stage < order.max_stages:
            first, count = await calls.call(src, SendOut(mid, stage, held), timeout)
            if count == 0 and stage > 0:
                break
            await calls.call(dst, RecvIn(mid, stage, first, count), timeout, DEST_FAILED)
            await asyncio.gather(stage_done(src, stage), stage_done(dst, stage))
            sent += count
            stage += 1
            if count <= FEW_BLOCKS:
                break
        pause_at = time.perf_counter()
        state, first, count = await calls.call(src, PauseOut(mid, stage, live, held), timeout)
        paused_at = time.perf_counter()
        await calls.call(dst, RecvIn(mid, stage, first, count), timeout, DEST_FAILED)
        sent += count
        await stage_done(dst, stage)  # every destination rank has its share: nothing is committed half-moved
        posted_at = time.perf_counter()
        committing = True
        await calls.call(dst, CommitIn(mid, state), timeout, DEST_FAILED)
        reserved = False
    except MigrationAborted as exc:
        if committing and await _committed_anyway(calls, mid, dst, timeout):
            logger.warning(f"migration {mid}: the destination's commit answered late ({exc}); it has the request")
            reserved = False
        else:
            result.outcome, result.message = exc.outcome, str(exc)
            if committing:  # it may still commit later: whatever it then runs is aborted, not streamed
                fleet.abort_on(dst, request_id)
            await _undo(calls, mid, src, dst, reserved, timeout)
    if result.outcome == MigrationOutcome.OK:
        # downtime: from the source's answer that the request is paused (its last step there is done)
        # to the destination's that it has taken it over; the wait for the source's current step
        # before that is not downtime (the request is computing its next token in it)
        result.downtime_s = time.perf_counter() - paused_at
        phases = {
            "pause": 1e3 * (paused_at - pause_at),
            "transfer": 1e3 * (posted_at - paused_at),
            "commit": 1e3 * (time.perf_counter() - posted_at),
        }
        result.phases_ms = phases
        result.stages, result.blocks, result.held_blocks = stage + 1, sent, held
        result.bytes = sent * fleet.block_bytes
        on_moved(request_id, src, dst)
    if result.outcome == MigrationOutcome.OK:  # committed: the source lets go (never resumes: the destination runs it)
        try:
            await calls.call(src, ReleaseOut(mid), timeout)
        except MigrationAborted as exc:
            logger.warning(f"migration {mid}: the source did not release {request_id}'s blocks: {exc}")
    result.total_s = time.perf_counter() - started
    if result.outcome == MigrationOutcome.OK:
        logger.info(
            f"migrated {request_id} instance {src} -> {dst} ({order.reason}): {result.blocks} blocks "
            f"({result.held_blocks} held there already) in "
            f"{result.stages} stage(s), downtime {result.downtime_s * 1e3:.1f} ms (transfer "
            f"{phases['transfer']:.1f}, commit {phases['commit']:.1f}), total "
            f"{result.total_s * 1e3:.0f} ms"
        )
    else:
        logger.info(
            f"migration of {request_id} instance {src} -> {dst} ({order.reason}) did not happen: "
            f"{result.outcome}: {result.message}"
        )
    return result


async def _committed_anyway(calls: InstanceCalls, mid: int, dst: int, timeout: float) -> bool:
    """After a commit that failed or answered too late: did the destination take the request over?"""
    try:
        return await calls.call(dst, CancelIn(mid), timeout, DEST_FAILED) == "committed"
    except MigrationAborted:
        return False  # gone or silent: the source keeps it (a late copy there is aborted)


async def _undo(calls: InstanceCalls, mid: int, src: int, dst: int, reserved: bool, timeout: float) -> None:
    """The request stays (or has ended) on the source; the destination lets go of its blocks."""
    undo = [calls.call(src, ResumeOut(mid), timeout)]
    if reserved:
        undo.append(calls.call(dst, CancelIn(mid), timeout))
    for outcome in await asyncio.gather(*undo, return_exceptions=True):
        if isinstance(outcome, BaseException):
            logger.warning(f"undoing migration {mid}: {outcome}")

"""One mirroring round from a source instance to its buddy, driven from the front end.

    source.offer -> entries        (the full blocks the buddy lacks, held on the source)
    buddy.reserve(entries) -> answers   (blocks it has already are leased; the rest get fresh blocks,
                                    their receive posted)
    source.send(answers)           (one transfer op; every rank sends its share beside its steps)
    ... both report the stage out ...
    buddy.commit                   (cached under their hashes, leased)   source.done(committed)

Any failure cancels on the buddy (its fresh blocks freed, its leases of the round ended) and the
source lets go of what it held; the next round offers those blocks again. The source's requests
never wait for any of it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from loguru import logger

from dist_infer.engine.migration import MigrationAborted, MigrationOutcome
from dist_infer.engine.mirror.entries import MIRROR_STAGE
from dist_infer.serving.fleet.instance_calls import InstanceCalls
from dist_infer.serving.fleet.mirror_wire import (
    MirrorCancel,
    MirrorCommit,
    MirrorDone,
    MirrorOffer,
    MirrorReserve,
    MirrorSend,
)

SOURCE_FAILED, DEST_FAILED = MigrationOutcome.SOURCE_FAILED, MigrationOutcome.DEST_FAILED


@dataclass
class RoundResult:
    """What a round did: `have` per request id (leading blocks the buddy holds now), blocks sent."""

    ok: bool
    offered: int = 0
    sent: int = 0
    have: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    message: str = ""


async def mirror_round(
    calls: InstanceCalls, mid: int, src: int, buddy: int, fraction: float, max_blocks: int, timeout: float
) -> RoundResult:
    """Mirror what `src`'s running requests computed since the last round to `buddy`."""
    started = time.perf_counter()
    entries, reserved, committed = [], False, False
    result = RoundResult(False)
    try:
        entries = await calls.call(src, MirrorOffer(mid, calls.peer(buddy), max_blocks), timeout, SOURCE_FAILED)
        if not entries:
            result.ok = True
            return result
        result.offered = sum(len(e.hashes) for e in entries)
        reserved = True
        answers = await calls.call(
            buddy, MirrorReserve(mid, calls.peer(src), tuple(entries), fraction), timeout, DEST_FAILED
        )
        result.sent = await calls.call(src, MirrorSend(mid, tuple(answers), calls.peer(buddy)), timeout, SOURCE_FAILED)
        await asyncio.gather(
            calls.wait_stage(src, mid, MIRROR_STAGE, timeout, SOURCE_FAILED, watch=(buddy,)),
            calls.wait_stage(buddy, mid, MIRROR_STAGE, timeout, DEST_FAILED, watch=(src,)),
        )
        committed = bool(await calls.call(buddy, MirrorCommit(mid), timeout, DEST_FAILED))
        result.ok = committed
        result.have = {e.request_id: a.have for e, a in zip(entries, answers)}
    except MigrationAborted as exc:
        result.message = f"{exc.outcome}: {exc}"
        logger.debug(f"mirror round {src} -> {buddy} failed: {result.message}")
    finally:
        undo = []
        if reserved and not committed:
            undo.append(calls.call(buddy, MirrorCancel(mid), timeout, DEST_FAILED))
        if entries:
            undo.append(calls.call(src, MirrorDone(mid, committed), timeout, SOURCE_FAILED))
        for outcome in await asyncio.gather(*undo, return_exceptions=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, MigrationAborted):
                logger.warning(f"mirror round {src} -> {buddy}: undoing it failed: {outcome}")
        result.seconds = time.perf_counter() - started
    return result

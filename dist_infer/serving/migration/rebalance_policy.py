"""The migration controller's policy: which request moves where, and why (pure, unit tested).

Every `--migrate-interval` seconds the controller pairs the most loaded instance with the least
loaded one (by freeness, serving/fleet/dispatch.py), as Llumnix does:

- an instance is a source when its queued demand exceeds what it has left (freeness below
  `out_below`: requests wait, or the next decodes will preempt), or when it is being drained;
- a destination must accept requests, have freeness above `in_above` and room for the request
  beyond its watermark;
- the request is the cheapest to move: a waiting one (no KV to copy) before a running one, and
  among running ones the one with the fewest blocks; a request that moved within `cooldown_s`
  is not picked again (no ping-pong), nor one already moving.

One migration per instance at a time; each is logged with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dist_infer.serving.fleet.dispatch import InstanceLoad

OUT_BELOW = 1.0  # a source has less than one free block per request once its queue is in
IN_ABOVE = 4.0  # a destination has several blocks per request to spare


@dataclass(frozen=True)
class MoveCandidate:
    request_id: str
    blocks: int  # 0 for a waiting request
    running: bool


@dataclass(frozen=True)
class PlannedMove:
    request_id: str
    src: int
    dst: int
    reason: str


def plan_moves(
    loads: list[InstanceLoad],
    candidates: dict[int, list[MoveCandidate]],
    busy: set[int],
    cooling: set[str],
    draining: set[int],
    out_below: float = OUT_BELOW,
    in_above: float = IN_ABOVE,
    buddies: Optional[dict[int, int]] = None,
) -> list[PlannedMove]:
    """This round's migrations. `candidates[i]`: the requests on instance i; `busy`: instances in
    a migration already; `cooling`: requests that moved recently; `draining`: instances to empty;
    `buddies`: where each instance's KV is mirrored (--kv-mirror): a draining instance's requests
    go there first, where only their unmirrored tail has to move."""
    by_index = {x.index: x for x in loads}
    sources = [x for x in loads if x.index not in busy and (x.index in draining or x.freeness < out_below)]
    sources.sort(key=lambda x: (x.index not in draining, x.freeness))
    dests = [x for x in loads if x.index not in busy and x.accepting and x.index not in draining]
    dests.sort(key=lambda x: -x.freeness)
    moves: list[PlannedMove] = []
    taken: set[int] = set()
    for src in sources:
        reason = "drain" if src.index in draining else ("queue" if src.waiting else "load")
        pick = sorted(
            (c for c in candidates.get(src.index, []) if c.request_id not in cooling),
            key=lambda c: (c.running, c.blocks),
        )
        order = dests
        if src.index in draining and buddies and src.index in buddies:
            order = sorted(dests, key=lambda d: d.index != buddies[src.index])  # stable: by freeness after
        for dst in order:
            if dst.index in taken or dst.index == src.index:
                continue
            if src.index not in draining and (dst.freeness <= in_above or dst.freeness <= src.freeness + 1):
                continue
            room = dst.available
            choice = next((c for c in pick if c.blocks + 2 <= room), None)
            if choice is None:
                continue
            moves.append(PlannedMove(choice.request_id, src.index, dst.index, reason))
            taken.update((src.index, dst.index))
            by_index[dst.index].pending_blocks += choice.blocks + 2
            break
    return moves

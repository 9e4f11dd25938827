"""What a mirroring round says of each request, both ways: the source offers blocks by hash, the
buddy answers which it needs sent (the others it holds already, under the same hash)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MIRROR_STAGE = 0  # a round is one transfer stage: every block offered, in one message per rank pair
# A request this long is where a failover without its mirror costs seconds and, with it, the gap is
# mostly the survivor's step in flight and the tail: the source mirrors its partial last block too
# (recomputing up to a block of tokens over a long context costs several decode steps), and the buddy
# paces its steps of prompts alone while it holds one (docs/benchmarks.md, "KV mirroring"). A short
# request's partial block is cheaper to recompute than to send every round, and pacing for it would
# cost every step of prompts alone for a gap that mirroring already holds to about one step.
LONG_REQUEST_TOKENS = 2048


def report_stage(mover, mid: int, notify: Callable[..., None]) -> bool:
    """Tell the front end (`notify`) if round `mid`'s transfers on this rank are out, or failed;
    False while they are still under way. Both sides of a round report so."""
    if not mover.stage_done(mid, MIRROR_STAGE):
        return False
    notify("stage_failed" if mid in mover.failures else "stage_done", mid, MIRROR_STAGE)
    return True


@dataclass(frozen=True)
class MirrorEntry:
    """Blocks `first`, `first + 1`, ... of a request's sequence, by their prefix-cache hashes; and
    `tail`, the token ids of the rows computed so far of the partial block after them (a long
    request's: its failover then recomputes nothing of it), or () for none."""

    request_id: str
    first: int
    hashes: tuple[int, ...]
    tail: tuple[int, ...] = ()


@dataclass(frozen=True)
class MirrorAnswer:
    """The buddy's word on an entry: `send[i]` for each block it takes (a prefix of those offered;
    False: it holds that hash already), and `have`, the leading blocks of the request it holds
    once the round commits (less than the entry's `first` when a lease was reclaimed: the source
    offers from there again)."""

    send: tuple[bool, ...]
    have: int
    tail: bool = False  # it takes the entry's partial block too (sent after its full ones)

"""Which original positions a rank's rows hold: runs, and the zigzag split of a sequence.

The ring never assumes row order equals position order: a rank's rows are described as runs
of consecutive positions, so the zigzag load-balanced split, a cached prefix, or several
sequences of a batch all go through one code path. Pure index arithmetic, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dist_infer.parallel.ring.errors import RingAttentionError


@dataclass(frozen=True)
class Run:
    """Rows [row, row + length) of a rank's tensor hold positions [start, start + length) of sequence `seq`."""

    seq: int
    row: int
    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def runs_from_positions(positions: Sequence[int], seq: int = 0, row: int = 0) -> list[Run]:
    """Cut a row -> position map into runs of consecutive positions."""
    positions = [int(p) for p in positions]
    runs: list[Run] = []
    i = 0
    while i < len(positions):
        j = i + 1
        while j < len(positions) and positions[j] == positions[j - 1] + 1:
            j += 1
        runs.append(Run(seq, row + i, positions[i], j - i))
        i = j
    return runs


@dataclass(frozen=True)
class ZigzagShard:
    """Rank `rank`'s part of a `seq_len`-token sequence under causal load balancing.

    The sequence, padded to 2 * cp * chunk tokens, is cut into 2 * cp chunks; the rank holds
    chunks `rank` and 2 * cp - 1 - rank, so every rank has the same share of the causal
    triangle. Padding lies at the end of the sequence, so it is never stored: `positions`
    lists only the valid original positions, in local row order, and `padding` counts the
    rows this rank would hold in the padded sequence beyond seq_len.
    """

    seq_len: int
    cp: int
    rank: int
    chunk: int

    @property
    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.cp - 1 - self.rank

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The valid [start, stop) position range of each of the two chunks (possibly empty)."""
        return [(min(c * self.chunk, self.seq_len), min((c + 1) * self.chunk, self.seq_len)) for c in self.chunks]

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(p for start, stop in self.ranges for p in range(start, stop))

    @property
    def num_rows(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    @property
    def padding(self) -> int:
        return 2 * self.chunk - self.num_rows

    def runs(self, seq: int = 0, row: int = 0) -> list[Run]:
        """At most two runs, computed from the chunk bounds (no per-token work: prompts may be long)."""
        runs: list[Run] = []
        for start, stop in self.ranges:
            if stop <= start:
                continue
            if runs and runs[-1].stop == start:  # chunks cp - 1 and cp are adjacent
                last = runs.pop()
                runs.append(Run(seq, last.row, last.start, last.length + stop - start))
            else:
                runs.append(Run(seq, row, start, stop - start))
            row += stop - start
        return runs


def zigzag_chunks(seq_len: int, cp: int, rank: int) -> ZigzagShard:
    """The zigzag index map of `rank` among `cp` ranks for a sequence of `seq_len` tokens (any length)."""
    if cp < 1 or not 0 <= rank < cp:
        raise RingAttentionError(f"rank {rank} is not a rank of a cp group of {cp}")
    if seq_len < 0:
        raise RingAttentionError(f"sequence length {seq_len} is negative")
    return ZigzagShard(seq_len, cp, rank, -(-seq_len // (2 * cp)))

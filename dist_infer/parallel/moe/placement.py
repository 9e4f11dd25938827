"""Expert placement: which ep rank owns each expert of a layer, how evenly that spreads the
measured load (`imbalance`), and a placement balanced from measured counts.

Its own module because the routing file, the statistics and the layer all need it, and it is
pure (plain numbers in, placements out; no tensors, no communicator), so it is unit tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dist_infer.parallel.sharding import ShardingError


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of the tokens per rank: 1.0 is perfect balance, ep means one rank got everything."""
    loads = [float(x) for x in loads]
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else 1.0


@dataclass(frozen=True)
class ExpertPlacement:
    """Which ep rank owns each expert of one layer; every rank owns the same number of experts."""

    owner: tuple  # owner[e] = ep rank of expert e
    ep: int

    def __post_init__(self):
        E, ep = len(self.owner), self.ep
        if E % ep:
            raise ShardingError(f"{E} experts cannot be split evenly over ep={ep} ({E} % {ep} = {E % ep})")
        bad = [o for o in self.owner if not 0 <= int(o) < ep]
        if bad:
            raise ShardingError(f"expert placement {list(self.owner)} names ranks {bad} outside ep={ep}")
        per_rank = [sum(1 for o in self.owner if o == r) for r in range(ep)]
        if len(set(per_rank)) != 1:
            raise ShardingError(
                f"expert placement {list(self.owner)} gives the {ep} ranks {per_rank} experts; each must own {E // ep}"
            )

    @classmethod
    def contiguous(cls, num_experts: int, ep: int) -> "ExpertPlacement":
        """Rank r owns experts [r*E/ep, (r+1)*E/ep): the default."""
        if num_experts % ep:
            raise ShardingError(
                f"{num_experts} experts cannot be split evenly over ep={ep} ({num_experts} % {ep} = {num_experts % ep})"
            )
        per = num_experts // ep
        return cls(tuple(e // per for e in range(num_experts)), ep)

    @property
    def num_experts(self) -> int:
        return len(self.owner)

    def local_experts(self, rank: int) -> list[int]:
        """The experts `rank` owns, ascending (the order of its local weights)."""
        return [e for e, o in enumerate(self.owner) if o == rank]

    def rank_loads(self, expert_counts: Sequence[float]) -> list[float]:
        loads = [0.0] * self.ep
        for e, n in enumerate(expert_counts):
            loads[self.owner[e]] += float(n)
        return loads


def balanced_placement(counts: Sequence[float], ep: int) -> list[int]:
    """An owner rank per expert that evens out the measured tokens per rank, E/ep experts each.

    Greedy longest-processing-time first (heaviest expert to the least loaded rank with room),
    then pairwise swaps between the heaviest rank and any other while they lower the heavier of
    the two. Deterministic: ties go to the lower expert id and the lower rank.
    """
    E = len(counts)
    if E % ep:
        raise ShardingError(f"{E} experts cannot be split evenly over ep={ep} ({E} % {ep} = {E % ep})")
    cap = E // ep
    counts = [float(c) for c in counts]
    owner = [-1] * E
    loads, sizes = [0.0] * ep, [0] * ep
    for e in sorted(range(E), key=lambda e: (-counts[e], e)):
        r = min((r for r in range(ep) if sizes[r] < cap), key=lambda r: (loads[r], r))
        owner[e], loads[r], sizes[r] = r, loads[r] + counts[e], sizes[r] + 1
    for _ in range(E * E):
        heavy = max(range(ep), key=lambda r: (loads[r], -r))
        best = None  # (new max of the pair, a, b)
        for a in (e for e in range(E) if owner[e] == heavy):
            for b in (e for e in range(E) if owner[e] != heavy and counts[e] < counts[a]):
                other = owner[b]
                delta = counts[a] - counts[b]
                pair_max = max(loads[heavy] - delta, loads[other] + delta)
                if pair_max < loads[heavy] - 1e-9 and (best is None or pair_max < best[0]):
                    best = (pair_max, a, b)
        if best is None:
            break
        _, a, b = best
        other, delta = owner[b], counts[a] - counts[b]
        owner[a], owner[b] = other, heavy
        loads[heavy] -= delta
        loads[other] += delta
    return owner

"""How many tokens a request proposes next, from what its recent proposals achieved.

A proposal the target rejects costs its verification rows and gives nothing; one it accepts saves a
whole step per token. So each request keeps its own length: doubled (up to K) after a round the
target took whole, cut to what was accepted plus one after a partial round, and after rounds that
took nothing it stops proposing for a while (1, 3, 7, 15 steps as misses repeat in a row) before it
tries one token again. A stream whose proposals never match then spends almost nothing on them;
one that starts copying is back at K within a few steps. Pure state, unit tested.
"""

from __future__ import annotations

MAX_PAUSE = 15  # steps without proposals after misses in a row, at most


class DraftLength:
    """One request's next proposal length (`next`), updated by each round's outcome (`record`);
    `adaptive` False: always K."""

    def __init__(self, k: int, adaptive: bool = True):
        self.k_max, self.adaptive = k, adaptive
        self.k = k
        self.misses = 0  # rounds in a row that accepted nothing
        self.pause = 0  # steps left without proposals

    def next(self) -> int:
        """The proposal length for this step (0: do not propose); counts down a pause."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return self.k

    def record(self, proposed: int, accepted: int) -> None:
        """A round that proposed `proposed` tokens, of which the target accepted `accepted`."""
        if not self.adaptive or proposed <= 0:
            return
        if accepted <= 0:
            self.misses += 1
            self.k = 1
            self.pause = min(2 ** (self.misses - 1) - 1, MAX_PAUSE)
            return
        self.misses = 0
        self.k = min(self.k_max, 2 * self.k if accepted >= proposed else accepted + 1)

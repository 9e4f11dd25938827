"""How many tokens a request proposes next: as many as are likely enough to be accepted to pay
for the rows they add to the step.

A request's proposals are accepted token after token with some probability alpha, estimated from
its recent rounds (each accepted proposal a success, the first rejected one a failure, old rounds
fading; an optimistic prior, since a request that proposes at all usually copies). The j-th
proposal of a round is kept only if all before it are, with probability alpha^j, and then it saves
the request a step's token; it costs one row more in the step, which the step-cost model prices
as a share `row_cost` of a plain step's token per request (engine/step_pacing.py
`draft_row_cost`: on a GPU's decode almost 0, on a few CPU cores a third or more, and more at a
larger batch). So the length is the largest j <= K with alpha^j > row_cost. A step with proposals also pays once
for having them (past 8 rows on a CPU the products leave the skinny kernels): the drafter proposes in
a step only if the expected gains of all its requests together (`expected_gain`) beat that.

Where not even one proposal pays, the request stops proposing for a while (1, 3, 7, 15 steps as it
happens again and again) and then tries one token, so a stream whose proposals never match spends
almost nothing on them, and one that starts copying is found again. Pure state, unit tested.
"""

from __future__ import annotations

MAX_PAUSE = 15  # steps without proposals after rounds that did not pay, at most
FADE = 0.8  # weight of the past rounds' counts per round: about the last five rounds count
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.8, 2.0  # what a request without rounds is assumed to accept


class DraftLength:
    """One request's next proposal length (`next`), learned from each round's outcome (`record`);
    `adaptive` False: always K."""

    def __init__(self, k: int, adaptive: bool = True):
        self.k_max, self.adaptive = k, adaptive
        self.accepted = self.rejected = 0.0  # faded counts of proposals kept and rounds cut short
        self.idle_rounds = 0  # times in a row no proposal paid
        self.pause = 0  # steps left without proposals
        self.probe = False  # the next round tries one token after a pause

    @property
    def acceptance(self) -> float:
        """The estimated chance that a proposal is accepted, given those before it were."""
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def next(self, row_cost: float = 0.0) -> int:
        """The proposal length for this step, given what a proposed row costs (0: do not propose)."""
        if not self.adaptive:
            return self.k_max
        if self.pause > 0:
            self.pause -= 1
            return 0
        if self.probe:
            self.probe = False
            return 1
        k, chance, alpha = 0, 1.0, self.acceptance
        while k < self.k_max and chance * alpha > row_cost:
            chance *= alpha
            k += 1
        if k == 0:
            self.idle_rounds += 1
            self.pause, self.probe = min(2 ** (self.idle_rounds - 1) - 1, MAX_PAUSE), True
        else:
            self.idle_rounds = 0
        return k

    def expected_gain(self, k: int, row_cost: float) -> float:
        """Tokens `k` proposals are expected to save, net of their rows' cost (in tokens): the j-th
        is kept with chance acceptance^j."""
        alpha, chance, gain = self.acceptance, 1.0, 0.0
        for _ in range(k):
            chance *= alpha
            gain += chance - row_cost
        return gain

    def record(self, proposed: int, accepted: int) -> None:
        """A round that proposed `proposed` tokens, of which the target accepted the first `accepted`."""
        if proposed <= 0:
            return
        self.accepted = FADE * self.accepted + accepted
        self.rejected = FADE * self.rejected + (1 if accepted < proposed else 0)

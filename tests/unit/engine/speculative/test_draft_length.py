"""A request's proposal length: the largest j <= K whose chance of being reached (acceptance^j)
beats the cost of a row; acceptance learned from its rounds with old ones fading; where not even
one proposal pays, pauses of 1, 3, 7, 15 steps (capped) each followed by a one-token probe; fixed
at K when not adaptive."""

from __future__ import annotations

import pytest

from dist_infer.engine.speculative.draft_length import MAX_PAUSE, PRIOR_ACCEPTANCE, DraftLength


def test_free_rows_propose_k_and_dear_rows_fewer():
    d = DraftLength(8)
    assert d.acceptance == pytest.approx(PRIOR_ACCEPTANCE)
    assert d.next(0.0) == 8, "rows cost nothing: all of K"
    assert d.next(0.5) == 3, "0.8^3 = 0.51 > 0.5 > 0.8^4"
    assert d.next(0.79) == 1


def test_acceptance_follows_the_rounds():
    d = DraftLength(8)
    for _ in range(5):
        d.record(8, 8)
    assert d.acceptance > 0.97 and d.next(0.5) == 8
    for _ in range(20):
        d.record(4, 1)
    assert d.acceptance < 0.6 and d.next(0.5) == 1, "kept one of four, again and again"


def test_when_nothing_pays_pauses_grow_with_a_probe_after_each():
    d = DraftLength(4)
    for _ in range(10):
        d.record(4, 0)
    pauses = []
    for _ in range(6):
        assert d.next(0.5) == 0, "a miss-only stream does not propose"
        steps = 0
        while (k := d.next(0.5)) == 0:
            steps += 1
        assert k == 1, "a probe of one token"
        d.record(1, 0)
        pauses.append(steps)
    assert pauses == [0, 1, 3, 7, MAX_PAUSE, MAX_PAUSE]


def test_a_probe_that_hits_brings_proposals_back():
    d = DraftLength(4)
    for _ in range(10):
        d.record(4, 0)
    assert d.next(0.3) == 0 and d.next(0.3) == 1  # the first pause is 0 steps: the probe comes next
    for _ in range(4):
        d.record(1, 1)
    assert d.next(0.3) >= 1 and d.idle_rounds == 0


def test_a_round_that_proposed_nothing_changes_nothing_and_fixed_length_when_not_adaptive():
    d = DraftLength(4)
    d.record(0, 0)
    assert d.acceptance == pytest.approx(PRIOR_ACCEPTANCE)
    fixed = DraftLength(5, adaptive=False)
    for proposed, accepted in [(5, 0), (5, 0), (5, 2)]:
        fixed.record(proposed, accepted)
        assert fixed.next(0.99) == 5

"""A request's proposal length: K at first, doubled back to K after a round kept whole, what was
kept plus one after a partial round, and after misses in a row a pause of 1, 3, 7, 15 steps
(capped) before one token is tried again; fixed at K when not adaptive."""

from __future__ import annotations

from dist_infer.engine.speculative.draft_length import MAX_PAUSE, DraftLength


def test_starts_at_k_and_a_round_kept_whole_doubles_back_to_k():
    d = DraftLength(8)
    assert d.next() == 8
    d.record(8, 3)
    assert d.next() == 4, "kept 3 of 8: propose 3 + 1"
    d.record(4, 4)
    assert d.next() == 8, "kept whole: doubled"
    d.record(8, 8)
    assert d.next() == 8, "never past K"


def test_misses_in_a_row_pause_longer_each_time_then_try_one_token():
    d = DraftLength(4)
    pauses = []
    for _ in range(6):
        d.record(d.k, 0)
        steps = 0
        while d.next() == 0:
            steps += 1
        pauses.append(steps)
        assert d.k == 1, "after a miss one token is tried"
    assert pauses == [0, 1, 3, 7, MAX_PAUSE, MAX_PAUSE]
    d.record(1, 1)
    assert d.misses == 0 and d.next() == 2, "a hit ends the pauses and grows again"


def test_a_round_that_proposed_nothing_changes_nothing():
    d = DraftLength(4)
    d.record(0, 0)
    assert (d.next(), d.misses) == (4, 0)


def test_fixed_length_when_not_adaptive():
    d = DraftLength(5, adaptive=False)
    for proposed, accepted in [(5, 0), (5, 0), (5, 2)]:
        d.record(proposed, accepted)
        assert d.next() == 5

"""Prompt-lookup proposals: the longest n-gram first, its most recent earlier occurrence with k
tokens after it (else the earliest), never the suffix itself, cut where the history ends; the same
as a plain reference on any history, and on a 32k-token one; `TokenHistory` grown in any chunks proposes the same."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dist_infer.engine.speculative.ngram import TokenHistory, propose_ngram


def reference_proposal(ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, written plainly: for n from n_max down, the latest start before the suffix's
    that k tokens follow, else the earliest start."""
    for n in range(n_max, n_min - 1, -1):
        if len(ids) < n + 1:
            continue
        suffix = ids[-n:]
        starts = [s for s in range(len(ids) - n) if ids[s : s + n] == suffix]
        if starts:
            whole = [s for s in starts if s + n + k <= len(ids)]
            start = max(whole) if whole else min(starts)
            return ids[start + n : start + n + k]
    return []


def test_the_tokens_after_an_earlier_occurrence_are_proposed():
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2], k=3, n_min=1, n_max=2) == [3, 4, 5]


def test_the_most_recent_occurrence_wins():
    ids = [1, 2, 10, 11, 1, 2, 20, 21, 5, 1, 2]
    assert propose_ngram(ids, k=2, n_min=2, n_max=2) == [20, 21]


def test_a_longer_match_is_preferred_to_a_more_recent_shorter_one():
    # "7 8 9" occurred at the start (followed by 1); "8 9" alone more recently (followed by 2)
    ids = [7, 8, 9, 1, 0, 8, 9, 2, 0, 7, 8, 9]
    assert propose_ngram(ids, k=1, n_min=1, n_max=3) == [1]
    assert propose_ngram(ids, k=1, n_min=1, n_max=2) == [2]


def test_the_suffix_does_not_match_itself():
    assert propose_ngram([4, 5, 6], k=3, n_min=1, n_max=3) == []
    assert propose_ngram([3], k=3, n_min=1, n_max=1) == []
    assert propose_ngram([], k=3, n_min=1, n_max=1) == []


def test_an_occurrence_may_overlap_the_suffix():
    # in a run of one token the latest earlier "5 5" ends one before the end: its follower is the last 5
    assert propose_ngram([1, 5, 5, 5], k=4, n_min=2, n_max=2) == [5]


def test_an_occurrence_with_k_followers_beats_a_later_one_with_fewer():
    # "1 2" at 0 (followed by 3 4 5 ...) and at 5 (followed by 6 and the suffix, three tokens)
    ids = [1, 2, 3, 4, 5, 1, 2, 6, 1, 2]
    assert propose_ngram(ids, k=4, n_min=2, n_max=2) == [3, 4, 5, 1]
    assert propose_ngram(ids, k=3, n_min=2, n_max=2) == [6, 1, 2], "with k=3 the later one has enough"


def test_the_end_of_the_history_cuts_the_proposal():
    # no occurrence has 10 after it: the earliest, which has the most
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1], k=10, n_min=1, n_max=1) == [2, 3, 1, 2, 3, 1]


def test_no_n_in_range_matching_gives_nothing():
    ids = [1, 2, 3, 9, 2, 3]  # "2 3" occurs earlier, "1 2 3"... at the end does not
    assert propose_ngram(ids, k=2, n_min=3, n_max=4) == []
    assert propose_ngram(ids, k=2, n_min=2, n_max=4) == [9, 2]


def test_n_larger_than_the_history_is_skipped():
    assert propose_ngram([1, 2, 1], k=2, n_min=1, n_max=50) == [2, 1]


@pytest.mark.parametrize(
    "k, n_min, n_max, name",
    [(0, 1, 2, "k"), (-3, 1, 2, "k"), (1.5, 1, 2, "k"), (True, 1, 2, "k"), (1, 0, 2, "n_min"), (1, 3, 2, "n_max")],
)
def test_arguments_out_of_range_are_refused_by_name(k, n_min, n_max, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        propose_ngram([1, 2, 1, 2], k, n_min, n_max)
    with pytest.raises(ValueError, match=f"^{name} must be"):
        TokenHistory([1, 2, 1, 2]).propose(k, n_min, n_max)


def test_numpy_integers_are_arguments_too():
    assert propose_ngram(np.array([1, 2, 1]), np.int64(2), np.int32(1), np.int64(1)) == [2, 1]


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), max_size=60),
    k=st.integers(1, 6),
    n_min=st.integers(1, 4),
    extra=st.integers(0, 4),
    cuts=st.lists(st.integers(0, 60), max_size=4),
)
def test_proposals_equal_the_reference(ids, k, n_min, extra, cuts):
    expected = reference_proposal(ids, k, n_min, n_min + extra)
    assert propose_ngram(ids, k, n_min, n_min + extra) == expected
    history = TokenHistory()
    for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(ids)]):
        history.extend(ids[a:b])
    assert history.token_ids() == ids and len(history) == len(ids)
    assert history.propose(k, n_min, n_min + extra) == expected


def test_a_32k_token_history():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50_000, size=32_768).tolist()
    pattern = [60_001, 60_002, 60_003, 60_004]
    ids[1_000:1_010] = [*pattern, 70_000, 70_001, 70_002, 70_003, 70_004, 70_005]
    ids[20_000:20_010] = [*pattern, 80_000, 80_001, 80_002, 80_003, 80_004, 80_005]
    ids[-4:] = pattern
    assert propose_ngram(ids, k=5, n_min=2, n_max=4) == [80_000, 80_001, 80_002, 80_003, 80_004]
    assert TokenHistory(ids).propose(k=5, n_min=2, n_max=4) == [80_000, 80_001, 80_002, 80_003, 80_004]
    # the latest occurrence of the 3-gram ending at the suffix's last 3 tokens is the same one
    assert propose_ngram(ids, k=3, n_min=1, n_max=3) == reference_proposal(ids, 3, 1, 3) == [80_000, 80_001, 80_002]
    # and when it is broken the earlier one is found
    ids[20_000] = 60_009
    assert propose_ngram(ids, k=2, n_min=4, n_max=4) == [70_000, 70_001]


def test_a_32k_run_of_one_token():
    ids = [7] * 32_768
    assert propose_ngram(ids, k=5, n_min=1, n_max=8) == [7] * 5, "the latest occurrence with 5 tokens after it"
    history = TokenHistory(ids)
    history.extend([8, 7, 7])  # "7 7" occurred just before the 8 (two tokens after it): an earlier one has 5
    assert history.propose(k=5, n_min=1, n_max=8) == reference_proposal([*ids, 8, 7, 7], 5, 1, 8) == [7, 7, 8, 7, 7]

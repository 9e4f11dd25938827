"""Prompt-lookup proposals: guess the next tokens from the request's own history.

Text that repeats (code being edited, a quoted document, a list that follows a pattern) repeats in
token ids too: when the history's last n tokens occurred earlier, the tokens that followed them
then are a good guess for what follows now. That is llama.cpp's lookup decoding and vLLM's ngram
proposer; it needs no draft model, and a wrong guess costs only the positions the target checks.

Longer matches are tried first (n_max down to n_min), as they predict better; among the
occurrences of one n-gram the most recent one that has k tokens after it wins, as the nearest
context is the likeliest to go on (one nearer the end would propose fewer: in a run of one repeated
token the latest occurrence is followed by a single token); where none has k, the one with the most.
The search is one vectorised pass over the history (numpy), so a proposal over 32k tokens costs
tens of microseconds; `TokenHistory` keeps a request's ids in a numpy buffer that grows with it,
so a step does not copy the whole history to propose.
"""

from __future__ import annotations

import numbers
from typing import Iterable, Sequence

import numpy as np


def _check_bounds(k: int, n_min: int, n_max: int) -> None:
    """ValueError naming the first argument out of range: k >= 1, 1 <= n_min <= n_max."""
    for name, value, low, floor in (
        ("k", k, 1, "1"),
        ("n_min", n_min, 1, "1"),
        ("n_max", n_max, n_min, f"n_min={n_min}"),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"{name} must be an integer >= {floor}, got {value!r}")


def _match_lengths(ids: np.ndarray, n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(ends, lengths): every earlier end e (e < len(ids)) with ids[e - 1] == ids[-1], and how many
    tokens, up to n_max, ids[:e] and ids share at their ends (the length of the match ending at e)."""
    last = len(ids) - 1
    ends = np.flatnonzero(ids[:last] == ids[last]) + 1
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))  # candidates still matching at every offset so far
    for back in range(1, min(n_max, last)):
        alive = alive[ends[alive] - 1 - back >= 0]
        alive = alive[ids[ends[alive] - 1 - back] == ids[last - back]]
        if not len(alive):
            break
        lengths[alive] += 1
    return ends, lengths


def _propose(ids: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """propose_ngram over a 1-D integer array (arguments already checked)."""
    if len(ids) < n_min + 1:  # no room for an earlier occurrence of even the shortest n-gram
        return []
    ends, lengths = _match_lengths(ids, n_max)
    for n in range(min(n_max, len(ids) - 1), n_min - 1, -1):
        matching = ends[lengths >= n]
        if len(matching):
            whole = matching[matching + k <= len(ids)]
            start = int(whole.max()) if len(whole) else int(matching.min())
            return ids[start : start + k].tolist()
    return []


def propose_ngram(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the last n tokens of `token_ids` (the
    prompt and the output so far), for the largest n in [n_min, n_max] that has one: the most recent
    occurrence with k tokens after it, else the earliest (the most after it, fewer than k); [] when
    no n has one.

    "Earlier" is any occurrence that starts before the suffix itself (it may overlap it: in a run
    of one repeated token the proposal is that token). ValueError naming k, n_min or n_max when
    k < 1 or not 1 <= n_min <= n_max."""
    _check_bounds(k, n_min, n_max)
    return _propose(np.asarray(token_ids, dtype=np.int64).reshape(-1), k, n_min, n_max)


class TokenHistory:
    """A request's token ids in a numpy buffer that doubles as it fills, for proposals without
    copying the history each step: `propose` gives what `propose_ngram` gives on the same ids."""

    def __init__(self, token_ids: Iterable[int] = ()):
        self._ids = np.zeros(64, dtype=np.int64)
        self._len = 0
        self.extend(token_ids)

    def __len__(self) -> int:
        return self._len

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append ids (the prompt, then each step's accepted tokens)."""
        new = np.fromiter(token_ids, dtype=np.int64)
        needed = self._len + len(new)
        if needed > len(self._ids):
            grown = np.zeros(max(needed, 2 * len(self._ids)), dtype=np.int64)
            grown[: self._len] = self._ids[: self._len]
            self._ids = grown
        self._ids[self._len : needed] = new
        self._len = needed

    def token_ids(self) -> list[int]:
        """The ids so far, as a list (a copy)."""
        return self._ids[: self._len].tolist()

    def propose(self, k: int, n_min: int, n_max: int) -> list[int]:
        """propose_ngram(self.token_ids(), k, n_min, n_max), without the copy."""
        _check_bounds(k, n_min, n_max)
        return _propose(self._ids[: self._len], k, n_min, n_max)

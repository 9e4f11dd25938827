"""Sequence parallelism's rows: each rank's share of a step's tokens, every token once, and when
it is on."""

from __future__ import annotations

import pytest

from dist_infer.parallel.sequence_parallel import sequence_rows, should_sequence_parallel


def test_sequence_rows_cover_every_token_once():
    for tokens in (1, 2, 5, 8, 62):
        for tp in (2, 3, 4):
            rows = [sequence_rows(tokens, tp, r) for r in range(tp)]
            assert all(per == -(-tokens // tp) for _, _, per in rows)
            covered = [t for start, count, _ in rows for t in range(start, start + count)]
            assert covered == list(range(tokens)), (tokens, tp, rows)
    assert should_sequence_parallel("on", 1, 2, 512) and not should_sequence_parallel("on", 4096, 1, 512)
    assert not should_sequence_parallel("auto", 511, 2, 512) and should_sequence_parallel("auto", 512, 2, 512)
    assert not should_sequence_parallel("auto", 10**6, 2, None)  # no measured threshold: auto stays off
    with pytest.raises(ValueError, match="sequence-parallel mode"):
        should_sequence_parallel("sometimes", 1, 2, 512)

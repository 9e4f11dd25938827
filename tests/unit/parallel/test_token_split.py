"""Splitting a step's tokens, in this process: the two halves the tp overlap runs (attention
metadata for each, every token once), when it splits, and the rows each rank keeps under sequence
parallelism. (The overlap run for real, exact against HF: tests/integration/test_shm_and_overlap.py.)"""

from __future__ import annotations

import pytest
import torch

from dist_infer.models.attention_metadata import build_attention_metadata, split_token_halves
from dist_infer.parallel.token_split import should_split


def test_split_token_halves_covers_every_token_once():
    q, s = [5, 1, 4], [5, 9, 4]  # a fresh prompt, a decode step with context, another prompt
    tables = [[0], [1], [2]]
    split = split_token_halves(q, s, tables, block_size=16)
    full = build_attention_metadata(q, s, tables, 16)
    assert split.cut == 5
    assert torch.equal(torch.cat([split.a.positions, split.b.positions]), full.positions)
    assert torch.equal(torch.cat([split.a.slot_mapping, split.b.slot_mapping]), full.slot_mapping)
    assert torch.equal(split.full.last_token_index, full.last_token_index)


def test_split_straddling_sequence_reads_first_half_from_cache():
    split = split_token_halves([7], [7], [[3]], block_size=16)  # one prompt cut in the middle
    assert (split.a.query_lens, split.a.seq_lens, split.a.fresh) == ([3], [3], True)
    assert (split.b.query_lens, split.b.seq_lens, split.b.fresh) == ([4], [7], False)


def test_should_split_modes():
    assert not should_split("off", 4096, 2, 1024)
    assert should_split("on", 2, 2, 1024)
    assert not should_split("on", 1, 2, 1024)  # one token cannot be split
    assert not should_split("on", 4096, 1, 1024)  # nothing to overlap without tp
    assert should_split("auto", 1024, 2, 1024) and not should_split("auto", 1023, 2, 1024)
    assert not should_split("auto", 1 << 20, 2, None)  # the CPU default: auto never splits
    with pytest.raises(ValueError, match="overlap mode"):
        should_split("sometimes", 10, 2, 1)


def test_sequence_rows_cover_every_token_once():
    from dist_infer.parallel.sequence_parallel import sequence_rows, should_sequence_parallel

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

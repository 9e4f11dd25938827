"""Attention metadata, no processes: slots, positions and the pad index of a mixed step, the causal
(and sliding-window) mask over cached context, when no mask is needed, and the two token halves
the tp overlap runs (every token once, a straddling sequence's second half reading the first
from the cache)."""

from __future__ import annotations

import pytest
import torch

from dist_infer.models.attention_metadata import build_attention_metadata, split_token_halves


def test_metadata_slots_positions_pad_index():
    bs = 4
    # seq 0: fresh prompt of 3; seq 1: 2 new tokens after 4 cached (positions 4, 5); seq 2: decode at position 9
    meta = build_attention_metadata([3, 2, 1], [3, 6, 10], [[5], [1, 7], [2, 0, 3]], bs)
    assert meta.positions.tolist() == [0, 1, 2, 4, 5, 9]
    assert meta.slot_mapping.tolist() == [20, 21, 22, 28, 29, 13]
    assert meta.max_q == 3 and meta.max_ctx == 10 and meta.batch == 3
    assert meta.pad_index.tolist() == [0, 1, 2, 3, 4, 6]
    assert meta.last_token_index.tolist() == [2, 4, 5]
    assert meta.block_tables.tolist() == [[5, 0, 0], [1, 7, 0], [2, 0, 3]]
    assert not meta.fresh and not meta.uniform


def test_metadata_uniform_fresh_prefill_has_no_mask():
    meta = build_attention_metadata([4, 4], [4, 4], [[0], [1]], 4)
    assert meta.fresh and meta.uniform and meta.mask is None
    assert meta.pad_index.tolist() == list(range(8))
    meta = build_attention_metadata([4, 2], [4, 2], [[0], [1]], 4)
    assert meta.fresh and meta.mask is not None  # mixed lengths need a mask


def _want_mask(q_lens, seq_lens, window=None):
    B, max_q, max_ctx = len(q_lens), max(q_lens), max(seq_lens)
    want = torch.zeros(B, max_q, max_ctx, dtype=torch.bool)
    for b, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for i in range(q):
            pos = s - q + i
            for j in range(s):
                want[b, i, j] = j <= pos and (window is None or j > pos - window)
    return want


@pytest.mark.parametrize("window", [None, 3])
def test_metadata_mask_causal_with_cached_context(window):
    q_lens, seq_lens = [3, 2, 1, 4], [3, 6, 10, 4]
    tables = [[0], [1, 2], [3, 4, 5], [6]]
    meta = build_attention_metadata(q_lens, seq_lens, tables, 4, window)
    mask = meta.mask[:, 0]
    assert mask.shape == (4, 4, 10)
    want = _want_mask(q_lens, seq_lens, window)
    for b, q in enumerate(q_lens):
        assert torch.equal(mask[b, :q], want[b, :q]), f"sequence {b}"
        assert not mask[b, :q, seq_lens[b] :].any(), "never beyond the sequence's own context"
        for i in range(q, meta.max_q):  # padded rows: exactly one key, so no NaN
            assert mask[b, i].sum() == 1


def test_metadata_sliding_window_forces_mask_on_long_prefill():
    meta = build_attention_metadata([6, 6], [6, 6], [[0, 1], [2, 3]], 4, sliding_window=4)
    assert meta.mask is not None
    assert torch.equal(meta.mask[:, 0], _want_mask([6, 6], [6, 6], 4))
    assert build_attention_metadata([3, 3], [3, 3], [[0], [1]], 4, sliding_window=4).mask is None


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


def test_prompt_rows_mark_each_sequences_prompt_tokens():
    """A decode, a prompt's whole chunk, and a chunk whose last token is already generated (a
    recomputed request): the prompt's rows only, the same whichever step they are in."""
    tables = [[0, 1], [2], [3]]
    meta = build_attention_metadata([1, 5, 3], [18, 5, 10], tables, 16, prompt_counts=[0, 5, 2])
    assert meta.prompt_rows.tolist() == [False] + [True] * 5 + [True, True, False]
    assert build_attention_metadata([1, 5], [18, 5], tables[:2], 16).prompt_rows is None
    assert build_attention_metadata([1, 5], [18, 5], tables[:2], 16, prompt_counts=[0, 0]).prompt_rows is None

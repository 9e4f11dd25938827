"""The token bitmask in plain torch, against a loop over the bits: which tokens a row allows, -inf
for the others (columns past the mask's width included), only the masked rows touched."""

from __future__ import annotations

import random

import pytest
import torch

from dist_infer.engine.structured.token_mask import (
    allocate_bitmask,
    allowed_tokens,
    allows_only,
    apply_bitmask_,
    mask_words,
)


def naive_allowed(bitmask: torch.Tensor, vocab: int) -> list[list[bool]]:
    out = []
    for row in bitmask.tolist():
        out.append([t < 32 * len(row) and bool((row[t // 32] >> (t % 32)) & 1) for t in range(vocab)])
    return out


def random_bitmask(rng: random.Random, rows: int, words: int, density: float) -> torch.Tensor:
    bits = [[rng.random() < density for _ in range(32 * words)] for _ in range(rows)]
    ints = [
        [sum(1 << j for j in range(32) if row[32 * w + j]) for w in range(words)]  # unsigned words
        for row in bits
    ]
    return torch.tensor(ints, dtype=torch.int64).to(torch.int32)  # bit 31 set: a negative int32, as llguidance writes


def test_words_and_a_fresh_mask_allows_everything():
    assert [mask_words(v) for v in (1, 32, 33, 1024, 151_936)] == [1, 1, 2, 32, 4748]
    mask = allocate_bitmask(3, 70)
    assert mask.shape == (3, 3) and mask.dtype == torch.int32
    assert allowed_tokens(mask, 70).all() and not allowed_tokens(mask, 100)[:, 96:].any()


@pytest.mark.parametrize("vocab,words", [(64, 2), (70, 3), (100, 3), (33, 1), (31, 1)])
def test_allowed_tokens_match_a_loop_over_the_bits(vocab, words):
    rng = random.Random(vocab * 10 + words)
    for density in (0.0, 0.1, 0.5, 0.97, 1.0):
        mask = random_bitmask(rng, 4, words, density)
        assert allowed_tokens(mask, vocab).tolist() == naive_allowed(mask, vocab), (vocab, words, density)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_sets_disallowed_logits_to_minus_inf_on_the_masked_rows_only(dtype):
    rng = random.Random(7)
    vocab, words = 90, 2  # columns 64..89 lie past the mask: never allowed
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1)).to(dtype)
    before = logits.clone()
    mask = random_bitmask(rng, 2, words, 0.4)
    rows = [3, 1]
    out = apply_bitmask_(logits, mask, rows)
    assert out is logits, "in place"
    allowed = naive_allowed(mask, vocab)
    for i, r in enumerate(rows):
        for t in range(vocab):
            want = before[r, t].item() if allowed[i][t] else float("-inf")
            assert logits[r, t].item() == want, (r, t)
    for r in (0, 2, 4):
        assert torch.equal(logits[r], before[r]), "an unmasked row is left alone"
    assert torch.equal(apply_bitmask_(before.clone(), mask[:0], []), before), "no rows: nothing"


def test_every_row_masked_in_order_is_the_same_as_row_by_row():
    rng = random.Random(3)
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    mask = random_bitmask(rng, 3, 2, 0.5)
    one_by_one = logits.clone()
    for r in range(3):
        apply_bitmask_(one_by_one, mask[r : r + 1], [r])
    assert torch.equal(apply_bitmask_(logits.clone(), mask, [0, 1, 2]), one_by_one)
    assert torch.equal(apply_bitmask_(logits.clone(), mask[[2, 0, 1]], [2, 0, 1]), one_by_one), "any order"


def test_a_mask_wider_than_the_logits_ignores_its_extra_bits():
    logits = torch.zeros(1, 40)
    mask = torch.tensor([[0, -1, -1]], dtype=torch.int32)  # allows 32..95; the logits stop at 40
    apply_bitmask_(logits, mask, [0])
    assert torch.isinf(logits[0, :32]).all() and (logits[0, 32:] == 0).all()


def test_allows_only_finds_a_grammar_that_can_only_end():
    mask = torch.zeros(3, dtype=torch.int32)
    mask[1] = 1 << 5  # token 37
    assert allows_only(mask, [37]) and allows_only(mask, [37, 2])
    assert not allows_only(mask, [2])
    mask[2] = torch.tensor(-(2**31), dtype=torch.int32)  # bit 31 of word 2: token 95
    assert allows_only(mask, [37, 95]) and not allows_only(mask, [37])
    assert allows_only(torch.zeros(2, dtype=torch.int32), []), "nothing allowed: nothing outside"
    before = mask.clone()
    allows_only(mask, [37, 95])
    assert torch.equal(mask, before), "the row is not changed"

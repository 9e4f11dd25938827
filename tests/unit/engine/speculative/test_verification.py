"""Verifying proposals changes what is emitted in no way but how many tokens a step gives.

Greedy: the tokens emitted are plain greedy decoding's (sample_rows) over the same positions, ties,
NaN, inf and banned tokens included. Sampled with a proposal from the history (a point mass): the
tokens plain sampling emits with the same seed, token for token. Sampled with a draft's
distribution: each emitted token has the target's distribution after temperature, top-k and top-p
(chi-square tests over 20,000 seeded draws), and a seed gives the same tokens every time.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from dist_infer.engine.sampling import RowSampling, row_probs, sample_rows, usable_logits
from dist_infer.engine.speculative.verification import verify_greedy, verify_sampled

DRAWS = 20_000
# the 0.99 quantiles of the chi-square distribution by degrees of freedom, i.e. the critical values at
# p = 0.01 (NIST/SEMATECH e-Handbook of Statistical Methods, table 1.3.6.7.4; scipy.stats.chi2.ppf(0.99, df))
CHI2_CRITICAL_P01 = {1: 6.635, 2: 9.210, 3: 11.345, 4: 13.277, 5: 15.086}

# two positions of a 6-token vocabulary, sampled at temperature 0.7 with top-k 5 and top-p 0.95: each
# keeps 4 tokens, none near the top-p boundary (the mass above the last kept is 0.936 and 0.904)
LOGITS = torch.tensor([[2.0, 1.4, 0.9, 0.3, -0.6, -2.0], [0.2, 1.1, -0.4, 0.8, 1.6, -1.0]])
ROW = RowSampling(temperature=0.7, top_k=5, top_p=0.95)


def plain_target_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The target's distribution by the definition, in float64: softmax(logits / T), the top k
    renormalised, then the smallest prefix (most likely first) whose mass reaches top_p."""
    probs = np.exp(np.array(logits) / temperature)
    order = np.argsort(-probs, kind="stable")
    probs[order[top_k:]] = 0.0
    probs /= probs.sum()
    above = np.cumsum(probs[order]) - probs[order]
    probs[order[above >= top_p]] = 0.0
    return probs / probs.sum()


def assert_distributed_as(tokens: list[int], probs: np.ndarray) -> None:
    """The tokens never take a zero-probability id, and pass Pearson's chi-square test against
    `probs` at p = 0.01 (degrees of freedom: the ids with probability > 0, less one)."""
    counts = np.bincount(tokens, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, counts
    expected = probs[support] * len(tokens)
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRITICAL_P01[int(support.sum()) - 1], (chi2, counts, expected)


def plain_greedy(logits: torch.Tensor, eos: int, bans: list[int]) -> list[int]:
    """Each position's token as the plain sampler picks it for a greedy row (ban_eos per position)."""
    rows = [RowSampling(ban_eos=b) for b in bans]
    return [int(sample_rows(logits[j : j + 1], [rows[j]], (eos,)).tokens[0]) for j in range(len(rows))]


def expected_emission(plain: list[int], proposed: list[int]) -> list[int]:
    """What plain decoding emits over the proposals' positions: up to and including its first
    disagreement with them, or all of them and one more."""
    for j, token in enumerate(proposed):
        if plain[j] != token:
            return plain[: j + 1]
    return plain


def awkward_logits(rng: random.Random, positions: int, vocab: int) -> torch.Tensor:
    """Logits full of exact ties, one-ulp near-ties, NaN, +-inf and whole rows of -inf or NaN."""
    near = float(np.nextafter(np.float32(1.0), np.float32(2.0)))
    values = [0.0, 1.0, 1.0, near, -1.0, float("nan"), float("inf"), float("-inf"), 3.0e38]
    out = torch.tensor([[rng.choice(values) for _ in range(vocab)] for _ in range(positions)])
    if rng.random() < 0.1:
        out[rng.randrange(positions)] = rng.choice([float("-inf"), float("nan")])
    return out


def test_greedy_emits_what_plain_greedy_decoding_does():
    rng = random.Random(0)
    for _ in range(400):
        k, vocab = rng.randrange(0, 6), rng.randrange(2, 8)
        logits = awkward_logits(rng, k + 1, vocab)
        eos, bans = rng.randrange(vocab), [int(rng.random() < 0.3) for _ in range(k + 1)]
        plain = plain_greedy(logits, eos, bans)
        proposed = [t if rng.random() < 0.7 else rng.randrange(vocab) for t in plain[:k]]
        banned = torch.zeros(k + 1, vocab, dtype=torch.bool)
        banned[:, eos] = torch.tensor(bans, dtype=torch.bool)
        assert verify_greedy(logits, proposed, banned) == expected_emission(plain, proposed)
        if not any(bans):
            assert verify_greedy(logits, proposed) == expected_emission(plain, proposed)


def test_greedy_with_random_logits_accepts_runs_of_agreement():
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        logits = torch.randn(5, 50, generator=gen).half().float()  # fp16-rounded: some near-ties
        plain = logits.argmax(-1).tolist()
        cut = int(torch.randint(0, 5, (), generator=gen))
        proposed = plain[:cut] + [(t + 1) % 50 for t in plain[cut:4]]
        assert verify_greedy(logits, proposed) == plain[: cut + 1]


def test_a_greedy_row_verifies_greedily_whatever_the_draft():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    draft = torch.tensor([[1.0, 0.0, 0.0]])
    assert verify_sampled(logits, [1], draft, RowSampling(temperature=0.0, seed=5)) == [1, 0]
    assert verify_sampled(logits, [2], None, RowSampling(temperature=1e-6)) == [1]


def test_sampling_a_history_proposal_emits_what_plain_sampling_does():
    rng = random.Random(2)
    for trial in range(300):
        k, vocab = rng.randrange(0, 5), rng.randrange(2, 7)
        logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(trial)) * rng.choice([0.3, 1, 4])
        if rng.random() < 0.2:
            logits = awkward_logits(rng, k + 1, vocab)
        row = RowSampling(
            rng.choice([0.5, 1.0, 2.0]), rng.choice([0, 2, 3]), rng.choice([1.0, 0.8]), trial, rng.randrange(9)
        )
        plain = [
            int(sample_rows(logits[j : j + 1], [replace(row, index=row.index + j)]).tokens[0]) for j in range(k + 1)
        ]
        proposed = [t if rng.random() < 0.6 else rng.randrange(vocab) for t in plain[:k]]
        assert verify_sampled(logits, proposed, None, row) == expected_emission(plain, proposed)


def test_the_target_probabilities_are_the_plain_definition():
    for j in range(2):
        expected = plain_target_probs(LOGITS[j].tolist(), ROW.temperature, ROW.top_k, ROW.top_p)
        assert (expected > 0).sum() == 4
        np.testing.assert_allclose(
            row_probs(usable_logits(LOGITS[j : j + 1])[0], ROW).double().numpy(), expected, atol=1e-6
        )


def test_a_point_mass_proposal_leaves_the_first_token_distributed_as_the_target():
    # proposing id 1 (probability 0.24): accepted about that often, the residual the rest of the time
    firsts = [verify_sampled(LOGITS[:2], [1], None, replace(ROW, seed=s))[0] for s in range(DRAWS)]
    assert_distributed_as(firsts, plain_target_probs(LOGITS[0].tolist(), ROW.temperature, ROW.top_k, ROW.top_p))


def test_a_draft_distribution_leaves_every_emitted_token_distributed_as_the_target():
    # the draft puts mass where the target has none (ids 4 and 5 at position 0, 2 and 5 at 1)
    draft = np.array([[0.10, 0.40, 0.05, 0.15, 0.20, 0.10], [0.30, 0.10, 0.25, 0.05, 0.10, 0.20]])
    proposals = np.stack([np.random.default_rng(j).choice(6, size=DRAWS, p=draft[j]) for j in range(2)], 1)
    target = torch.cat([LOGITS, LOGITS[1:]])  # K = 2: the bonus position as the second
    draft_probs = torch.from_numpy(draft).float()
    outs = [verify_sampled(target, proposals[s].tolist(), draft_probs, replace(ROW, seed=s)) for s in range(DRAWS)]
    p = [plain_target_probs(LOGITS[j].tolist(), ROW.temperature, ROW.top_k, ROW.top_p) for j in range(2)]
    assert_distributed_as([out[0] for out in outs], p[0])
    # the second token (emitted when the first proposal was accepted) is independent of the first here
    seconds = [out[1] for out in outs if len(out) > 1]
    assert len(seconds) > DRAWS // 3
    assert_distributed_as(seconds, p[1])


def test_a_seed_gives_the_same_tokens_every_time():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    draft = torch.softmax(torch.randn(4, 40, generator=torch.Generator().manual_seed(4)), -1)
    proposed = [int(t) for t in logits[:4].argmax(-1)]
    for q in (None, draft):
        runs = [
            [verify_sampled(logits, proposed, q, RowSampling(1.0, 0, 1.0, seed, 7)) for seed in range(50)]
            for _ in range(2)
        ]
        assert runs[0] == runs[1]
        assert len({tuple(out) for out in runs[0]}) > 1  # the seed matters


def test_a_draft_equal_to_the_target_is_always_accepted():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(5))
    row = RowSampling(temperature=0.9, top_p=0.9, seed=11)
    draft = torch.stack([row_probs(logits[j], replace(row, index=j)) for j in range(3)])
    for seed in range(200):
        proposed = [int(t) for t in torch.multinomial(draft, 1, generator=torch.Generator().manual_seed(seed))[:, 0]]
        out = verify_sampled(logits, proposed, draft, replace(row, seed=seed))
        assert out[:3] == proposed and len(out) == 4


def test_a_token_the_target_excludes_is_never_accepted():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    row = RowSampling(temperature=1.0, top_k=2)
    for seed in range(200):
        for draft in (None, torch.tensor([[0.0, 0.0, 0.0, 1.0]])):
            out = verify_sampled(logits, [3], draft, replace(row, seed=seed))
            assert len(out) == 1 and out[0] in (0, 1)


def test_banned_tokens_are_never_emitted():
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 5.0, 0.0], [5.0, 5.0, 0.0]])
    banned = torch.tensor([[False, True, False]] * 3)
    draft = torch.full((2, 3), 1 / 3)
    for seed in range(100):
        for q in (None, draft):
            out = verify_sampled(logits, [0, 2], q, RowSampling(temperature=1.0, seed=seed), banned)
            assert 1 not in out
    assert verify_greedy(logits, [0, 2], banned) == [0, 0]  # 0 and 2 tie without 1: the first wins


@pytest.mark.parametrize(
    "shape, proposed, draft_shape, message",
    [
        ((3, 5), [1], None, "target_logits must be"),
        ((5,), [], None, "target_logits must be"),
        ((2, 5), [5], None, "proposed token ids"),
        ((2, 5), [-1], None, "proposed token ids"),
        ((2, 5), [1], (1, 4), "draft_probs must be"),
        ((3, 5), [1, 2], (1, 5), "draft_probs must be"),
    ],
)
def test_inputs_that_do_not_fit_are_refused(shape, proposed, draft_shape, message):
    draft = None if draft_shape is None else torch.full(draft_shape, 0.2)
    with pytest.raises(ValueError, match=message):
        verify_sampled(torch.zeros(shape), proposed, draft, RowSampling(temperature=1.0))
    if draft is None:
        with pytest.raises(ValueError, match=message):
            verify_greedy(torch.zeros(shape), proposed)


def test_the_steps_own_draws_give_the_first_two_tokens_the_targets_distribution():
    """What the engine's step does (StepPlan.position_rows, sample_rows over the K + 1 positions,
    accepted_prefix), on a Markov "model" over 6 tokens whose logits after token t are table[t]:
    over 20,000 seeds, with random proposals, the first and second emitted tokens are distributed
    as plain sampling's (a rejected first proposal leaves the second token to the next step, drawn
    at its own index as plain sampling draws it)."""
    from dist_infer.engine.speculative.verification import accepted_prefix
    from dist_infer.engine.step_plan import StepPlan

    gen = torch.Generator().manual_seed(3)
    first, table = torch.randn(6, generator=gen) * 1.5, torch.randn(6, 6, generator=gen) * 1.5
    rng = random.Random(4)
    proposals = [[rng.randrange(6), rng.randrange(6)] for _ in range(DRAWS)]
    # every seed's step in one sample_rows call (each row still draws with its own generator)
    rows = [replace(ROW, top_k=0, top_p=1.0, seed=seed, index=0) for seed in range(DRAWS)]
    positions = [r for row in rows for r in StepPlan(sample=[3], rows=[row]).position_rows()]
    logits = torch.stack([torch.stack([first, table[p[0]], table[p[1]]]) for p in proposals]).reshape(-1, 6)
    targets = sample_rows(logits, positions).tokens.view(DRAWS, 3).tolist()
    emitted = [t[: accepted_prefix(p, t) + 1] for p, t in zip(proposals, targets)]
    cut = [i for i, e in enumerate(emitted) if len(e) == 1]  # the next step draws their second token
    seconds = sample_rows(table[[emitted[i][0] for i in cut]], [replace(rows[i], index=1) for i in cut])
    for i, token in zip(cut, seconds.tokens.tolist()):
        emitted[i].append(token)
    counts = [np.bincount([e[0] for e in emitted], minlength=6), np.bincount([e[1] for e in emitted], minlength=6)]
    plain = replace(ROW, top_k=0, top_p=1.0)
    p0 = row_probs(usable_logits(first[None])[0], plain).double().numpy()
    p1 = sum(p0[t] * row_probs(usable_logits(table[t][None])[0], plain).double().numpy() for t in range(6))
    for got, want in ((counts[0], p0), (counts[1], p1)):
        expected = want * DRAWS
        chi2 = float(((got - expected) ** 2 / expected).sum())
        assert chi2 < CHI2_CRITICAL_P01[5], (chi2, got, expected)

"""Sampling that cannot overflow: every parameter either is refused by name when the request is
made, or gives a valid token with a finite logprob, whatever the logits.

A temperature of 1e-300 used to divide logits to inf, a top_p of 1e-50 rounded to 0 in fp32 and
dropped every token, and a 400-digit top_k overflowed the float64 step plan; each killed the
serving instance. Seeded draws for ordinary parameters are pinned to what they were before.

The ordinary filters and draws: top-k, top-p (top-k first), greedy with its log-probs, seeded
draws that depend only on their own sequence, and parameter validation.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, strategies as st

from dist_infer.engine.sampling import (
    GREEDY_BELOW,
    MAX_STOP_TOKEN_IDS,
    TOP_K_LIMIT,
    RowSampling,
    SamplingParams,
    SamplingParamsError,
    filter_logits,
    sample_rows,
)

EOS = 2
SPECIAL_FLOATS = [
    0.0,
    -0.0,
    5e-324,
    2.2e-308,
    1e-300,
    1e-50,
    1e-40,
    1e-6,
    9.99e-6,
    GREEDY_BELOW,
    1.0000001e-5,
    0.5,
    1.0,
    1.0000001,
    100.0,
    100.0000001,
    1e300,
    -1e-300,
    -1.0,
    math.inf,
    -math.inf,
    math.nan,
]
SPECIAL_INTS = [0, 1, 2, 5, 2**31 - 1, 2**31, 2**63, 10**400, -1, -(10**400)]

# every float and a 400-digit int can come, with the in-range ones (and their edges) drawn most
temperatures = st.one_of(
    st.sampled_from(SPECIAL_FLOATS),
    st.floats(0, 100),
    st.floats(0, 2e-5),
    st.floats(0, 100),
    st.floats(0, 100),
    st.floats(),
    st.integers(-(10**400), 10**400),
)
top_ps = st.one_of(
    st.sampled_from(SPECIAL_FLOATS),
    st.floats(0, 1),
    st.floats(0, 1e-30, exclude_min=True),
    st.floats(0, 1, exclude_min=True),
    st.floats(0, 1, exclude_min=True),
    st.floats(),
    st.integers(-(10**400), 10**400),
)
top_ks = st.one_of(
    st.sampled_from(SPECIAL_INTS),
    st.integers(-10, 10**400),
    st.integers(0, 300),
    st.sampled_from([3.0, 2.5, math.inf, math.nan]),
)


def _logits(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random logits, or the hostile kinds a model can give: -inf bans, huge values, NaN, ties."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    if kind == "minus-inf":
        x[:, ::2] = float("-inf")
    elif kind == "huge":
        x = x * 1e37
    elif kind == "extremes":
        x[:, 0], x[:, -1] = 3.4e38, -3.4e38
    elif kind == "nan-and-inf":
        x[:, 1], x[:, 3 % vocab] = float("nan"), float("inf")
    elif kind == "all-minus-inf":
        x[:] = float("-inf")
    elif kind == "all-nan":
        x[:] = float("nan")
    elif kind == "all-equal":
        x[:] = 7.0
    elif kind == "only-eos":
        x[:] = float("-inf")
        x[:, EOS] = 1.0
    return x


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    temperature=temperatures,
    top_k=top_ks,
    top_p=top_ps,
    kind=st.sampled_from(
        ["normal", "minus-inf", "huge", "extremes", "nan-and-inf", "all-minus-inf", "all-nan", "all-equal", "only-eos"]
    ),
    vocab=st.integers(3, 64),
    seed=st.integers(0, 2**53 - 1),
    index=st.one_of(st.integers(0, 3), st.integers(0, 10**6)),
    ban_eos=st.booleans(),
    logprobs=st.integers(0, 20),
)
def test_any_parameters_are_refused_by_name_or_give_a_valid_token(
    temperature, top_k, top_p, kind, vocab, seed, index, ban_eos, logprobs
):
    try:
        params = SamplingParams(
            max_new_tokens=4,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            logprobs=logprobs,
            min_tokens=4 if ban_eos else 0,
        )
    except SamplingParamsError as exc:
        assert exc.field in ("temperature", "top_k", "top_p") and exc.field in str(exc)
        assert len(str(exc)) < 200, "the message stays short even for a 400-digit value"
        event(f"refused: {exc.field}")
        return
    event("sampled greedily" if params.greedy else "sampled")
    assert pickle.loads(pickle.dumps(params)) == params
    row = RowSampling.of(params, seed, index)
    floats = torch.tensor([row.temperature, row.top_k, row.top_p], dtype=torch.float64)  # how the step plan sends it
    assert floats.tolist() == [row.temperature, row.top_k, row.top_p]
    logits = _logits(kind, 2, vocab, seed % 1000)
    out = sample_rows(logits, [row, row], (EOS,))
    assert all(0 <= t < vocab for t in out.tokens.tolist())
    assert torch.isfinite(out.logprobs).all(), (out.tokens, out.logprobs)
    if params.greedy:
        greedy = RowSampling(ban_eos=row.ban_eos)
        assert torch.equal(out.tokens, sample_rows(logits, [greedy, greedy], (EOS,)).tokens)
    if row.ban_eos and kind != "only-eos":
        assert EOS not in out.tokens.tolist()


# --- temperature ------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40, 1e-6, 9.99e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(temperature):
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1)) * 50
    params = SamplingParams(temperature=temperature, top_p=0.9, top_k=40, seed=5)
    assert params.greedy
    for index in range(4):
        got = sample_rows(logits, [RowSampling.of(params, 5 + b, index) for b in range(3)])
        want = sample_rows(logits, [RowSampling.of(SamplingParams(seed=5), 5 + b, index) for b in range(3)])
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)


def test_temperature_exactly_the_greedy_bound_samples_even_from_huge_logits():
    """At 1e-5, logits of 1e37 divide past fp32's range; the draw goes on from the row max down."""
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(2)) * 1e37
    params = SamplingParams(temperature=GREEDY_BELOW, seed=1)
    assert not params.greedy
    out = sample_rows(logits, [RowSampling.of(params, 1, 0), RowSampling.of(params, 2, 0)])
    assert out.tokens.tolist() == logits.argmax(-1).tolist(), "the rest are e**-1e42 below the max"
    assert torch.isfinite(out.logprobs).all()


def test_hot_temperature_with_a_tiny_top_p_is_the_argmax():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3))
    rows = [RowSampling.of(SamplingParams(temperature=100.0, top_p=1e-50, seed=9), 9, i) for i in range(4)]
    assert sample_rows(logits, rows).tokens.tolist() == logits.argmax(-1).tolist()


# --- top-p and top-k --------------------------------------------------------------------------------


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-50, 1e-30])
def test_top_p_below_fp32_keeps_the_most_likely_token(top_p):
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(4))
    kept = torch.isfinite(filter_logits(logits, 0, top_p))
    assert kept.sum(-1).tolist() == [1, 1, 1] and kept.float().argmax(-1).tolist() == logits.argmax(-1).tolist()
    rows = [RowSampling.of(SamplingParams(temperature=1.0, top_p=top_p, seed=3), 3, i) for i in range(3)]
    assert sample_rows(logits, rows).tokens.tolist() == logits.argmax(-1).tolist()


def test_a_400_digit_top_k_is_no_limit():
    params = SamplingParams(temperature=0.8, top_k=10**400, seed=11)
    assert params.top_k == TOP_K_LIMIT and pickle.loads(pickle.dumps(params)) == params
    unlimited = SamplingParams(temperature=0.8, top_k=0, seed=11)
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(5))
    for index in range(6):
        got = sample_rows(logits, [RowSampling.of(params, 11 + b, index) for b in range(2)]).tokens
        want = sample_rows(logits, [RowSampling.of(unlimited, 11 + b, index) for b in range(2)]).tokens
        assert torch.equal(got, want)
    assert torch.equal(filter_logits(logits, 10**400, 1.0), logits)


@pytest.mark.parametrize(
    "top_k", [-1, -(10**5000), 2.5, math.inf, math.nan], ids=["-1", "minus-5000-digits", "2.5", "inf", "nan"]
)
def test_a_bad_top_k_is_refused_by_name(top_k):
    with pytest.raises(SamplingParamsError, match="top_k") as info:
        SamplingParams(top_k=top_k)
    assert info.value.field == "top_k" and len(str(info.value)) < 200


def test_a_whole_float_top_k_is_an_int():
    assert SamplingParams(top_k=40.0).top_k == 40 and isinstance(SamplingParams(top_k=40.0).top_k, int)


# --- stop token ids ---------------------------------------------------------------------------------


def test_more_stop_token_ids_than_the_limit_are_refused_by_name():
    # a 16 MiB body carries millions: each would be checked per token and pickled with every move
    with pytest.raises(SamplingParamsError, match="stop_token_ids") as info:
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    assert info.value.field == "stop_token_ids" and str(MAX_STOP_TOKEN_IDS) in str(info.value)
    assert len(str(info.value)) < 200


def test_the_limit_of_stop_token_ids_is_taken_as_a_tuple_and_a_set():
    params = SamplingParams(stop_token_ids=[float(t) for t in range(MAX_STOP_TOKEN_IDS)])
    assert params.stop_token_ids == tuple(range(MAX_STOP_TOKEN_IDS))
    assert all(type(t) is int for t in params.stop_token_ids)
    assert params.stop_token_set == frozenset(range(MAX_STOP_TOKEN_IDS))
    # the set is derived: equality, repr and a pickle round trip are the tuple's
    assert params == SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)))
    assert "stop_token_set" not in repr(params)
    again = pickle.loads(pickle.dumps(params))
    assert again == params and again.stop_token_set == params.stop_token_set
    assert SamplingParams().stop_token_set == frozenset()


@pytest.mark.parametrize(
    "ids",
    [[-1], [3, 2.5], [math.nan], [math.inf], ["7"], [None], [-(10**5000)], "12", 7],
    ids=["negative", "fraction", "nan", "inf", "string-id", "none", "minus-5000-digits", "a-string", "an-int"],
)
def test_a_bad_stop_token_id_is_refused_by_name(ids):
    with pytest.raises(SamplingParamsError, match="stop_token_ids") as info:
        SamplingParams(stop_token_ids=ids)
    assert info.value.field == "stop_token_ids" and len(str(info.value)) < 200


# --- hostile logits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["all-minus-inf", "all-nan", "nan-and-inf", "extremes", "all-equal"])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 0.7, 100.0])
def test_hostile_logits_give_a_token_with_a_finite_logprob(kind, temperature):
    logits = _logits(kind, 3, 50, 6)
    rows = [RowSampling(temperature, 5, 0.5, 7, i, 3) for i in range(3)]
    out = sample_rows(logits, rows)
    assert ((out.tokens >= 0) & (out.tokens < 50)).all() and torch.isfinite(out.logprobs).all()


def test_only_eos_allowed_but_banned_still_gives_a_token():
    logits = _logits("only-eos", 1, 20, 0)
    for temperature in (0.0, 1.0):
        out = sample_rows(logits, [RowSampling(temperature, ban_eos=1)], (EOS,))
        assert 0 <= int(out.tokens[0]) < 20 and torch.isfinite(out.logprobs).all()


def test_more_logprobs_than_the_vocabulary_are_all_of_it():
    out = sample_rows(torch.tensor([[0.0, 2.0, 1.0]]), [RowSampling(logprobs=20)])
    assert out.top_ids.tolist() == [[1, 2, 0]]


# --- ordinary parameters are unchanged ----------------------------------------------------------------


def test_seeded_draws_are_the_ones_drawn_before_the_fix():
    """Tokens recorded from the sampler as it was before these guards: the same random draws."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2024)) * 2
    settings_ = [(0.7, 0, 1.0), (1.0, 40, 0.9), (1.3, 5, 1.0), (0.5, 0, 0.95)]
    got = [
        sample_rows(logits, [RowSampling(t, k, p, 40 + b, i) for b, (t, k, p) in enumerate(settings_)]).tokens.tolist()
        for i in range(8)
    ]
    assert got == [
        [26, 154, 4, 202],
        [152, 147, 4, 202],
        [15, 5, 49, 202],
        [87, 92, 278, 202],
        [168, 11, 278, 202],
        [32, 246, 32, 80],
        [100, 11, 28, 156],
        [2, 154, 278, 24],
    ]


# --- the ordinary filters and draws -----------------------------------------------------------------


def test_filter_logits_top_k():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, -1.0, 2.0, 1.0, 3.0]])
    out = filter_logits(logits, 2, 1.0)
    assert torch.isinf(out).sum(-1).tolist() == [3, 3]
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]]) and torch.equal(out[1, [2, 4]], logits[1, [2, 4]])
    assert torch.equal(filter_logits(logits, 0, 1.0), logits)
    assert torch.equal(filter_logits(logits, 5, 1.0), logits)
    assert torch.equal(filter_logits(logits, 99, 1.0), logits)


def test_filter_logits_top_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05 (not in index order)
    logits = probs.log()[None]

    def kept(top_p, top_k=0):
        return sorted(torch.nonzero(torch.isfinite(filter_logits(logits, top_k, top_p)[0])).flatten().tolist())

    assert kept(0.4) == [1]  # the top token alone already covers 0.4
    assert kept(0.7) == [1, 3]  # 0.5 < 0.7 <= 0.8
    assert kept(0.9) == [1, 2, 3]  # 0.8 < 0.9 <= 0.95
    assert kept(0.99) == [0, 1, 2, 3]
    assert kept(1e-6) == [1], "the most likely token is always kept"
    assert kept(0.9, top_k=2) == [1, 3], "top-k first, then top-p over what is left"
    # filtered logits keep their values
    out = filter_logits(logits, 0, 0.7)[0]
    assert torch.equal(out[[1, 3]], logits[0, [1, 3]])
    assert not torch.equal(filter_logits(logits, 0, 0.7), logits), "the input is not modified in place"
    assert torch.isfinite(logits).all()


def test_sample_greedy_and_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen)
    out = sample_rows(logits, [RowSampling() for _ in range(3)])
    assert out.tokens.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(
        out.logprobs.float(), torch.log_softmax(logits, -1).gather(-1, out.tokens[:, None])[:, 0]
    )


def test_sample_seeded_is_deterministic_and_per_sequence():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 200, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)

    def draw(rows, seed=7, steps=6):
        """Tokens 0..steps-1 of each row's request (the row index is its own seed offset)."""
        return [
            [int(sample_rows(logits[[b]], [RowSampling.of(params, seed + b, i)]).tokens[0]) for i in range(steps)]
            for b in rows
        ]

    full = draw([0, 1, 2, 3])
    assert full == draw([0, 1, 2, 3]), "same seed, same tokens"
    assert [full[1], full[3]] == draw([1, 3]), "a sequence's draws do not depend on the rest of the batch"
    assert full != draw([0, 1, 2, 3], seed=8), "another seed, other tokens"
    batched = [
        sample_rows(logits, [RowSampling.of(params, 7 + b, i) for b in range(4)]).tokens.tolist() for i in range(6)
    ]
    assert [list(col) for col in zip(*batched)] == full, "the same draws in one batched call"
    allowed = torch.isfinite(filter_logits(logits / 0.8, 20, 0.9))
    for b, row in enumerate(full):
        assert all(allowed[b, t] for t in row), "samples only from the filtered set"
    one = SamplingParams(temperature=1.0, top_k=1, seed=3)
    tokens = sample_rows(logits, [RowSampling.of(one, 3, 0) for _ in range(4)]).tokens
    assert tokens.tolist() == logits.argmax(-1).tolist(), "top_k=1 is greedy"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)

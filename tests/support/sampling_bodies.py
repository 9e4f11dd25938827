"""Completions bodies with sampling parameters across their whole domain (hypothesis): the API's
fuzz test in process and the real-instances test both draw from `sampling_bodies()`."""

from __future__ import annotations

import hypothesis.strategies as st

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.just(10**399),
    st.just(-(10**399)),
    st.just(2**63),
    st.just(2**53),
    st.just(-1),
    st.just(0),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(allow_subnormal=True, min_value=-1e-300, max_value=1e-300),
    st.sampled_from([0.0, -0.0, 5e-324, 1e308, -1e308, 1e-45, 100.0, 100.00000000000001, 1.0, 0.9999999999999999]),
    st.text(max_size=8),
    st.sampled_from(["inf", "-inf", "nan", "1e400", "0x10", "", "1"]),
)
TINY = st.sampled_from([5e-324, 1e-310, 1e-300, 1e-45, 1e-8])
VALID = {  # each parameter's own domain, edges included, so that many bodies reach the sampler
    "temperature": st.one_of(st.floats(0, 100), TINY, st.sampled_from([0, 100, 99.99999999999999])),
    "top_p": st.one_of(st.floats(5e-324, 1), TINY, st.just(1)),
    "top_k": st.one_of(st.integers(-1, 2000), st.sampled_from([1, 999, 1000, 1001, 2**62])),
    "seed": st.one_of(st.integers(0, 2**53 - 1), st.sampled_from([0, 2**53 - 1])),
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 4),
    "logprobs": st.integers(0, 20),
    "ignore_eos": st.booleans(),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 2000), max_size=4),
    "n": st.just(1),
    "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0),
    "repetition_penalty": st.just(1),
    "best_of": st.just(1),
    "echo": st.just(False),
}


@st.composite
def sampling_bodies(draw) -> dict:
    """A completions body with up to 4 sampling parameters in their domains and up to 1 anything-JSON."""
    body = {"prompt": draw(st.sampled_from([[1, 2, 3], "hi there", [5]])), "max_tokens": 4}
    for name in draw(st.sets(st.sampled_from(sorted(VALID)), max_size=4)):
        body[name] = draw(VALID[name])
    for name in draw(st.sets(st.sampled_from(sorted(VALID)), max_size=1)):
        body[name] = draw(st.one_of(JSON_SCALARS, st.lists(JSON_SCALARS, max_size=3)))
    body["stream"] = draw(st.booleans())
    return body

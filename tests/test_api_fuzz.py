"""Fuzzing the HTTP API in-process: schemathesis drives every operation of /openapi.json, and
hypothesis draws sampling parameters across their whole domain; no input may give a 5xx.

The fake engine (test_api_server.py's) also runs the real sampler (engine.sampling.sample_rows)
on random logits with each request's parameters, so values that pass validation but break
sampling show up here as 500s. Bounded: a fixed number of examples, no deadline per example.
"""

from __future__ import annotations

import json

import hypothesis.strategies as st
import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from test_api_server import MODEL, FakeEngine, fake_tokens

from dist_infer.engine.sampling import RowSampling, sample_rows
from dist_infer.serving.api_server import build_app

GREEDY = {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
FUZZ_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(HealthCheck))


class SamplingFakeEngine(FakeEngine):
    """The fake engine, calling the real sample_rows for every token it makes (its tokens stay the
    fake's, so greedy answers are known exactly)."""

    def __init__(self):
        super().__init__()
        self.token_delay = 0.0

    def reset(self):
        super().reset()
        self.token_delay = 0.0

    async def generate(self, request_id, prompt_token_ids, params):
        logits_gen = torch.Generator().manual_seed(len(prompt_token_ids))
        index = 0
        async for out in super().generate(request_id, prompt_token_ids, params):
            logits = torch.randn(1, self.vocab_size, generator=logits_gen) * 8
            sample_rows(logits, [RowSampling.of(params, params.seed or 0, index)], eos_ids=(2,))
            index += 1
            yield out


ENGINE = SamplingFakeEngine()
APP = build_app(ENGINE, MODEL)
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


def no_server_error(status: int, text: str) -> None:
    assert status < 500, (status, text[:2000])
    if status == 200 and "data: " in text:  # a stream's errors come as events after its 200
        assert '"code": 500' not in text and '"code":500' not in text, text[:2000]


def test_before_fuzzing_a_greedy_completion_is_known():
    with TestClient(APP, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == fake_tokens([1, 2, 3], 8)


@SCHEMA.parametrize()
@FUZZ_SETTINGS
def test_no_operation_answers_5xx(case):
    response = case.call()
    no_server_error(response.status_code, response.text)


def test_after_fuzzing_the_server_is_healthy_and_unchanged():
    with TestClient(APP, raise_server_exceptions=False) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == fake_tokens([1, 2, 3], 8)
    assert not ENGINE._held and ENGINE.free_blocks == ENGINE.total_blocks
    assert not APP.state.serving.active


# -- sampling parameters across their whole domain ----------------------------------------------------

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(10 ** 400), max_value=10 ** 400),
    st.just(10 ** 399), st.just(-(10 ** 399)), st.just(2 ** 63), st.just(2 ** 53), st.just(-1), st.just(0),
    st.floats(allow_nan=False, allow_infinity=False), st.floats(allow_subnormal=True, min_value=-1e-300, max_value=1e-300),
    st.sampled_from([0.0, -0.0, 5e-324, 1e308, -1e308, 1e-45, 100.0, 100.00000000000001, 1.0, 0.9999999999999999]),
    st.text(max_size=8), st.sampled_from(["inf", "-inf", "nan", "1e400", "0x10", "", "1"]),
)
TINY = st.sampled_from([5e-324, 1e-310, 1e-300, 1e-45, 1e-8])
VALID = {  # each parameter's own domain, edges included, so that many bodies reach the sampler
    "temperature": st.one_of(st.floats(0, 100), TINY, st.sampled_from([0, 100, 99.99999999999999])),
    "top_p": st.one_of(st.floats(5e-324, 1), TINY, st.just(1)),
    "top_k": st.one_of(st.integers(-1, 2000), st.sampled_from([1, 999, 1000, 1001, 2 ** 62])),
    "seed": st.one_of(st.integers(0, 2 ** 53 - 1), st.sampled_from([0, 2 ** 53 - 1])),
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 4),
    "logprobs": st.integers(0, 20),
    "ignore_eos": st.booleans(),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 2000), max_size=4),
    "n": st.just(1), "presence_penalty": st.just(0), "frequency_penalty": st.just(0.0),
    "repetition_penalty": st.just(1), "best_of": st.just(1), "echo": st.just(False),
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


@settings(max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(body=sampling_bodies())
def test_sampling_parameters_are_400_or_200_never_5xx(body):
    raw = json.dumps(body)  # Python ints of any size are JSON numbers
    with TestClient(APP, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), (body, r.status_code, r.text[:2000])
    no_server_error(r.status_code, r.text)
    if r.status_code == 400:
        assert r.json()["error"]["param"], (body, r.text)

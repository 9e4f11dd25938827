"""Fuzzing the HTTP API in-process: schemathesis drives every operation of /openapi.json, and
hypothesis draws sampling parameters across their whole domain; no input may give a 5xx.

The fake engine (tests/support/fake_engine.py's) also runs the real sampler
(engine.sampling.sample_rows) on random logits with each request's parameters, so values that
pass validation but break sampling show up here as 500s. Bounded: a fixed number of examples, no deadline per example.
"""

from __future__ import annotations

import json

import schemathesis
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from dist_infer.engine.sampling import RowSampling, sample_rows
from dist_infer.serving.http.api_server import build_app
from tests.support.fake_engine import MODEL, FakeEngine, fake_tokens
from tests.support.sampling_bodies import sampling_bodies

GREEDY = {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}
FUZZ_SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


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


# -- sampling parameters across their whole domain (support/sampling_bodies.py) -------------------


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

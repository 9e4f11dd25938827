"""Honest request handling (serving/http/protocol.py, serving/http/unserved_fields.py), through the app in
process: a field of OpenAI's or vLLM's schema that the server does not serve is a 400 naming it
unless its value asks for nothing; a number must be a JSON number and a boolean a JSON boolean;
fields the server serves, and fields of neither schema, answer as before."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from dist_infer.serving.http.api_server import build_app
from dist_infer.serving.http.unserved_fields import ANY, CHAT_UNSERVED, COMPLETIONS_UNSERVED
from tests.support.fake_engine import MODEL, FakeEngine, FakeTokenizer, fake_tokens

ENDPOINTS = {  # endpoint -> (a body it serves, the tokens that body gets, the endpoint's table)
    "completions": ({"prompt": [1, 20, 30], "max_tokens": 3}, fake_tokens([1, 20, 30], 3), COMPLETIONS_UNSERVED),
    "chat/completions": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        fake_tokens(FakeTokenizer().encode("<s><|user|>hi\n<|assistant|>"), 3),
        CHAT_UNSERVED,
    ),
}

# a value of each unserved field that asks for something (a request a client could really make)
ASKING = {
    "n": 2,
    "best_of": 3,
    "echo": True,
    "suffix": "the end",
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "logit_bias": {"50": 5},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "flex",
    "use_beam_search": True,
    "length_penalty": 2.0,
    "min_p": 0.1,
    "repetition_penalty": 1.2,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 10,
    "prompt_logprobs": 1,
    "allowed_token_ids": [50, 51],
    "bad_words": ["x"],
    "logits_processors": ["pkg.Processor"],
    "return_tokens_as_token_ids": True,
    "guided_whitespace_pattern": " ",
    "structural_tag": "{}",
    "prompt_embeds": "AAAA",
    "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "include_reasoning": False,
    "mm_processor_kwargs": {"x": 1},
    "media_io_kwargs": {"x": 1},
    "priority": 1,
    "request_id": "mine",
    "kv_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1},
}
ADD_SPECIAL_TOKENS_ASKING = {"completions": False, "chat/completions": True}


@pytest.fixture(scope="module")
def api():
    engine = FakeEngine()
    with TestClient(build_app(engine, MODEL), raise_server_exceptions=False) as c:
        yield engine, c


def post(api, endpoint: str, **fields):
    engine, c = api
    engine.token_delay = 0.0
    body, want, _ = ENDPOINTS[endpoint]
    return c.post(f"/v1/{endpoint}", json={**body, **fields}), want


def assert_400(response, param: str):
    assert response.status_code == 400, (param, response.status_code, response.text)
    err = response.json()["error"]
    assert err["param"] == param and err["code"] == 400, err
    return err["message"]


def test_every_refusing_row_has_an_asking_value():
    for endpoint, (_, _, table) in ENDPOINTS.items():
        refusing = {name for name, row in table.items() if row.noop != ANY}
        assert refusing == set(ASKING) | {"add_special_tokens"}, (endpoint, refusing ^ set(ASKING))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("field", sorted(ASKING) + ["add_special_tokens"])
def test_unserved_field_is_400_naming_it(api, endpoint, field):
    value = ADD_SPECIAL_TOKENS_ASKING[endpoint] if field == "add_special_tokens" else ASKING[field]
    response, _ = post(api, endpoint, **{field: value})
    message = assert_400(response, field)
    assert field in message, message


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("pick", [0, -1, None], ids=["first-noop", "last-noop", "null"])
def test_values_that_ask_for_nothing_are_served_unchanged(api, endpoint, pick):
    """Every row at once at a value that asks for nothing (null, or one of its noop values): 200, same tokens."""
    table = ENDPOINTS[endpoint][2]
    fields = {}
    for name, row in table.items():
        if pick is None:
            fields[name] = None
        elif row.noop == ANY:
            fields[name] = "a hint"
        elif row.noop:
            fields[name] = row.noop[pick]
    response, want = post(api, endpoint, **fields)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == want


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_unserved_defaults_compare_as_json_types(api, endpoint):
    """0 is not false and false is not 0 (in Python, False == 0); 1.0 is 1 (integral floats count as integers)."""
    assert_400(post(api, endpoint, use_beam_search=0)[0], "use_beam_search")
    assert_400(post(api, endpoint, priority=False)[0], "priority")
    assert_400(post(api, endpoint, n=True)[0], "n")
    response, want = post(api, endpoint, n=1.0, presence_penalty=0, repetition_penalty=1.0, logit_bias={})
    assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == want, response.text


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_cache_salt_is_served_and_must_be_a_short_non_empty_string(api, endpoint):
    """vLLM's cache_salt: a salt changes which cached prefixes a request may use, never its tokens;
    anything but a non-empty string of at most 256 characters is a 400 naming it."""
    for salt in ("tenant-7", "s" * 256, None):
        response, want = post(api, endpoint, cache_salt=salt)
        assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == want, response.text
    for bad in ("", "s" * 257, 5, True, ["a"], {"a": 1}):
        message = assert_400(post(api, endpoint, cache_salt=bad)[0], "cache_salt")
        assert "cache_salt" in message, message


NOT_NUMBERS = [True, False, "4", "", "0.5", [4], {"v": 4}]
NUMBER_FIELDS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("field", NUMBER_FIELDS)
def test_a_number_must_be_a_json_number(api, endpoint, field):
    for value in NOT_NUMBERS:
        assert_400(post(api, endpoint, **{field: value})[0], field)


@pytest.mark.parametrize(
    "endpoint,field",
    [("completions", "logprobs"), ("chat/completions", "top_logprobs"), ("chat/completions", "max_completion_tokens")],
)
def test_endpoint_numbers_must_be_json_numbers(api, endpoint, field):
    for value in NOT_NUMBERS:
        extra = {"logprobs": True} if field == "top_logprobs" else {}
        assert_400(post(api, endpoint, **{field: value}, **extra)[0], field)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_max_tokens_true_string_and_fraction_are_400_and_integral_float_is_an_integer(api, endpoint):
    for value in (True, "4", 4.5):
        message = assert_400(post(api, endpoint, max_tokens=value)[0], "max_tokens")
        assert "max_tokens" in message, message
    response, want = post(api, endpoint, max_tokens=3.0)
    assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == want, response.text
    assert_400(post(api, endpoint, stop_token_ids=[True])[0], "stop_token_ids")


def test_a_number_too_large_for_a_double_is_400():
    with TestClient(build_app(FakeEngine(), MODEL), raise_server_exceptions=False) as c:
        r = c.post(
            "/v1/completions",
            content=b'{"prompt": [1, 2], "temperature": 1e400}',
            headers={"content-type": "application/json"},
        )
    assert_400(r, "temperature")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("field", ["stream", "ignore_eos", "return_token_ids"])
def test_a_boolean_must_be_a_json_boolean(api, endpoint, field):
    for value in ("true", "yes", 1, 0, [True]):
        assert_400(post(api, endpoint, **{field: value})[0], field)
    assert_400(post(api, endpoint, stream=True, stream_options={"include_usage": "yes"})[0], "stream_options")


def test_chat_logprobs_and_completion_echo_must_be_booleans(api):
    assert_400(post(api, "chat/completions", logprobs=1)[0], "logprobs")
    assert_400(post(api, "completions", echo=0)[0], "echo")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_served_fields_and_fields_of_neither_schema_answer_as_before(api, endpoint):
    body = {
        "temperature": 0.0,
        "top_p": 1,
        "top_k": -1,
        "seed": 7,
        "min_tokens": 1,
        "ignore_eos": False,
        "stop_token_ids": [],
        "return_token_ids": True,
        "user": "u",
        "stream": False,
        "some_future_field": {"x": 1},
        "max_tokens": 3,
    }
    response, want = post(api, endpoint, **body)
    assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == want, response.text

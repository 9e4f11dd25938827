"""A prompt refused by its length before any work (serving/http/prompt_size.py): the bound's arithmetic,
and the API answering 400 `context_length_exceeded` without tokenizing, templating or scanning
the ids, while a prompt at the bound still goes to the tokenizer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from dist_infer.serving.http.api_server import build_app
from dist_infer.serving.http.guard import ApiError
from dist_infer.serving.http.json_body import ProtocolError, json_of
from dist_infer.serving.http.prompt_size import CONTEXT_LENGTH_EXCEEDED, PromptLimits, message_chars
from tests.support.fake_engine import MAX_MODEL_LEN, MODEL, FakeEngine, FakeTokenizer

CHARS_PER_TOKEN = 3
BOUND = MAX_MODEL_LEN * CHARS_PER_TOKEN


def test_limits_refuse_what_cannot_fit_and_name_the_field_and_bound():
    limits = PromptLimits(100, 4)
    assert limits.max_chars == 400
    limits.check_chars(400, "prompt")
    with pytest.raises(ApiError) as err:
        limits.check_chars(401, "prompt")
    assert (err.value.status, err.value.param, err.value.code) == (400, "prompt", CONTEXT_LENGTH_EXCEEDED)
    assert "maximum context length is 100 tokens" in err.value.message and "400 characters" in err.value.message
    limits.check_tokens(100, "prompt")
    with pytest.raises(ApiError, match="your prompt has 101 tokens"):
        limits.check_tokens(101, "prompt")
    PromptLimits(100, None).check_chars(10**9, "prompt")  # a tokenizer without a bound: no refusal by length


@pytest.mark.parametrize(
    "prompt, refused",
    [
        ("x" * 400, False),
        ("x" * 401, True),
        (["x" * 401], True),
        (list(range(100)), False),
        (list(range(101)), True),
        ([list(range(101))], True),
        (["a", "b"] * 300, False),  # a batch: prompt_of's to refuse
        (None, False),
        (5, False),
        ([], False),
    ],
)
def test_completion_prompts_are_checked_in_every_form(prompt, refused):
    limits = PromptLimits(100, 4)
    if refused:
        with pytest.raises(ApiError, match="maximum context length"):
            limits.check_completion_prompt(prompt)
    else:
        limits.check_completion_prompt(prompt)


def test_message_chars_sums_text_contents_and_ignores_the_rest():
    messages = [
        {"role": "system", "content": "abc"},
        {"role": "user", "content": [{"type": "text", "text": "de"}, "f"]},
        {"role": "assistant", "content": None},
        "junk",
        {"role": "user", "content": [{"type": "image"}, 7]},
    ]
    assert message_chars(messages) == 6
    assert message_chars("not a list") == 0 and message_chars(None) == 0


class SpyTokenizer(FakeTokenizer):
    """FakeTokenizer that says no token covers more than CHARS_PER_TOKEN characters and counts its encodes."""

    max_chars_per_token = CHARS_PER_TOKEN

    def __init__(self):
        self.encoded = 0

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.encoded += 1
        return super().encode(text, add_bos)


class SpyEngine(FakeEngine):
    def __init__(self):
        super().__init__()
        self.tokenizer = SpyTokenizer()
        self.checked = 0

    def check_request(self, prompt_token_ids, params):
        self.checked += 1
        return super().check_request(prompt_token_ids, params)


def call(app, path: str, body) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as h:
            return await h.post(path, json=body)

    return asyncio.run(go())


def assert_context_error(r: httpx.Response, param: str, needle: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, CONTEXT_LENGTH_EXCEEDED, "BadRequestError"), err
    assert needle in err["message"], err


def test_an_oversize_text_prompt_is_refused_without_tokenizing():
    engine = SpyEngine()
    app = build_app(engine, MODEL)
    r = call(app, "/v1/completions", {"prompt": "x" * (BOUND + 1), "max_tokens": 1})
    assert_context_error(r, "prompt", f"at most {BOUND:,} characters")
    r = call(app, "/v1/completions", {"prompt": ["y" * (BOUND + 1)], "max_tokens": 1})
    assert_context_error(r, "prompt", f"{BOUND + 1:,} characters")
    assert engine.tokenizer.encoded == 0 and engine.checked == 0
    # at the bound it is tokenized, then refused by its tokens (one per character here)
    r = call(app, "/v1/completions", {"prompt": "x" * BOUND, "max_tokens": 1})
    assert engine.tokenizer.encoded == 1
    assert_context_error(r, "prompt", f"your prompt has {BOUND + 1:,} tokens")


def test_oversize_chat_messages_are_refused_before_templating():
    engine = SpyEngine()
    app = build_app(engine, MODEL)
    rendered = []
    app.state.serving.renderer.render = lambda *a, **k: rendered.append(a) or "never"
    half = BOUND // 2 + 1
    body = {
        "messages": [
            {"role": "system", "content": "s" * half},
            {"role": "user", "content": [{"type": "text", "text": "u" * half}]},
        ]
    }
    assert_context_error(call(app, "/v1/chat/completions", body), "messages", "your messages have")
    assert rendered == [] and engine.tokenizer.encoded == 0


def test_oversize_token_id_prompts_are_refused_before_any_scan():
    engine = SpyEngine()
    app = build_app(engine, MODEL)
    for prompt in ([5] * (MAX_MODEL_LEN + 1), [[5] * (MAX_MODEL_LEN + 1)], [10**9] * 100_000):
        assert_context_error(
            call(app, "/v1/completions", {"prompt": prompt, "max_tokens": 1}),
            "prompt",
            f"maximum context length is {MAX_MODEL_LEN} tokens",
        )
    assert engine.checked == 0
    r = call(app, "/v1/completions", {"prompt": [5] * 100, "max_tokens": 1})
    assert r.status_code == 200 and engine.checked >= 1  # the spy does see a prompt that fits


def test_tokenize_counts_any_length_as_vllm_does():
    r = call(build_app(SpyEngine(), MODEL), "/tokenize", {"prompt": "x" * (BOUND + 10)})
    assert r.status_code == 200 and r.json()["count"] == BOUND + 11


def test_a_tokenizer_without_a_bound_refuses_by_tokens_only():
    engine = FakeEngine()  # FakeTokenizer has no max_chars_per_token
    r = call(build_app(engine, MODEL), "/v1/completions", {"prompt": "x" * 10_000, "max_tokens": 1})
    assert_context_error(r, "prompt", "your prompt has 10,001 tokens")


def test_json_walk_passes_over_id_lists_but_not_what_hides_in_them():
    ids = list(range(100_000))
    assert json_of(json.dumps({"prompt": ids}).encode())["prompt"] == ids
    with pytest.raises(ProtocolError, match="too large for a double") as err:
        json_of(json.dumps({"prompt": ids + [1e400]}).encode().replace(b"Infinity", b"1e400"))
    assert err.value.field == "prompt"
    with pytest.raises(ProtocolError, match="surrogate"):
        json_of(b'{"prompt": "' + "é".encode() * 100 + b'\\udc00"}')
    with pytest.raises(ProtocolError, match="surrogate"):
        json_of(b'{"\\uD800": 1}')

"""Structured outputs and tools through a real `dist-infer serve` (tp=2 instance) over HTTP: every
request form, streamed and not, the openai client's `parse` with a pydantic model, tool calls forced
by `required` and by name (valid for their schemas, streamed deltas equal to the whole reply), and
bad schemas, regexes and tools refused with a 400 naming the field before anything is queued."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.support.serving_helpers import ServerJob
from tests.support.structured_checkpoints import write_structured_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-serve")
    path = write_structured_checkpoint(root)
    args = ["--model", path, "--nproc", "2", "--tp", "2", "--block-size", "8", "--kv-blocks", "128", "--timeout", "60"]
    with ServerJob(root, args) as job:
        yield job
        assert job.stop() == 0, job.log()[-4000:]


def post(server, endpoint: str, body: dict) -> httpx.Response:
    with httpx.Client(trust_env=False, timeout=120) as client:
        return client.post(f"{server.url}/v1/{endpoint}", json=body)


def completion_text(server, **fields) -> tuple[str, str]:
    r = post(server, "completions", {"prompt": "Person:", "max_tokens": 120, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["finish_reason"]


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
        {"guided_json": SCHEMA},
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": SCHEMA, "temperature": 1.0, "seed": 3},
    ],
)
def test_each_schema_form_gives_valid_json(server, fields):
    text, reason = completion_text(server, **fields)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_choice_regex_and_grammar(server):
    text, _ = completion_text(server, response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict)
    text, _ = completion_text(server, guided_choice=["yes", "no", "maybe"])
    assert text in ("yes", "no", "maybe")
    text, _ = completion_text(server, guided_regex=r"[0-9]{3}-[a-c]{2}")
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", text), text
    text, _ = completion_text(server, guided_grammar='start: "x" ("y" | "z")')
    assert text in ("xy", "xz")


def test_streamed_equals_whole(server):
    body = {"prompt": "Person:", "max_tokens": 120, "temperature": 0, "guided_json": SCHEMA}
    whole = post(server, "completions", body).json()["choices"][0]["text"]
    text = ""
    with httpx.Client(trust_env=False, timeout=120) as client:
        with client.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
    assert text == whole


def test_the_openai_clients_parse_with_a_pydantic_model(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", http_client=httpx.Client(trust_env=False))
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    result = parse(model=client.models.list().data[0].id, messages=MESSAGES, response_format=Person, max_tokens=120)
    person = result.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120 and len(person.name) <= 6


# the generic tool prompt lists the tools as JSON: a few hundred of the byte-level tokenizer's tokens
# of the model's 512 positions, which leaves about 100 for the reply
REPLY_TOKENS = 100


def _chat(server, **fields) -> dict:
    r = post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": REPLY_TOKENS, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _streamed_chat(server, **fields) -> tuple[dict, str]:
    body = {"messages": MESSAGES, "max_tokens": REPLY_TOKENS, "temperature": 0, "stream": True, **fields}
    calls: dict[int, dict] = {}
    reason = None
    with httpx.Client(trust_env=False, timeout=120) as client:
        with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                reason = choice["finish_reason"] or reason
                for delta in choice["delta"].get("tool_calls", []):
                    call = calls.setdefault(delta["index"], {"name": None, "arguments": "", "id": None})
                    if "id" in delta:
                        assert call["id"] is None, "a call's id comes once, with its name"
                        call["id"], call["name"] = delta["id"], delta["function"]["name"]
                    call["arguments"] += delta["function"].get("arguments", "")
    return calls, reason


def test_required_tools_give_valid_calls_streamed_as_whole(server):
    choice = _chat(server, tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False)
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for call in calls:
        tool = {"get_weather": WEATHER, "now": NOW}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    streamed, reason = _streamed_chat(server, tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False)
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]


def test_a_named_tool_and_one_call_only(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _chat(server, tools=[WEATHER, NOW], tool_choice=named)
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and choice["message"]["content"] is None
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    streamed, _ = _streamed_chat(server, tools=[WEATHER, NOW], tool_choice=named)
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [("get_weather", call["function"]["arguments"])]


def test_parallel_calls_are_each_valid_when_the_reply_completes(server):
    choice = _chat(server, tools=[NOW], tool_choice="required")
    calls = choice["message"]["tool_calls"]
    assert calls and {c["function"]["name"] for c in calls} == {"now"}
    complete = calls if choice["finish_reason"] == "tool_calls" else calls[:-1]  # cut by max_tokens: the last
    for call in complete:
        assert json.loads(call["function"]["arguments"]) == {}


@pytest.mark.parametrize(
    "endpoint, fields, param",
    [
        ("completions", {"guided_json": {"type": "nonsense"}}, "guided_json"),
        ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
        (
            "completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"minimum": "x"}}}},
            "response_format",
        ),
        ("completions", {"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ("completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("chat/completions", {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_structures_are_400s_naming_the_field(server, endpoint, fields, param):
    body = {"prompt": "x"} if endpoint == "completions" else {"messages": MESSAGES}
    r = post(server, endpoint, {**body, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text

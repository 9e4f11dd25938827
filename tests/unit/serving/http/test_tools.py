"""A chat request's tools: the checks (400s naming the field), the grammar's schema for required
and named calls (validated with jsonschema), the reply read back, and both ways of rendering."""

from __future__ import annotations

import json

import jsonschema
import pytest

from dist_infer.serving.http.chat import ChatRenderer
from dist_infer.serving.http.json_body import ProtocolError
from dist_infer.serving.http.tool_call_parsing import ParsedReply, ToolCall
from dist_infer.serving.http.tools import (
    generic_tool_messages,
    messages_for_template,
    template_uses_tools,
    tool_plan_of,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "today's weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
            "required": ["city"],
            "$defs": {"unit": {"enum": ["C", "F"]}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "now"}}


def test_no_tools_is_no_plan_and_tools_default_to_auto():
    assert tool_plan_of({}) is None
    assert tool_plan_of({"tool_choice": "none"}) is None
    plan = tool_plan_of({"tools": [WEATHER, TIME]})
    assert plan.choice == "auto" and plan.parallel and [t.name for t in plan.tools] == ["get_weather", "now"]
    assert plan.output_schema() is None and plan.stream_parser() == "hermes"


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({"tools": {"a": 1}}, "tools", "list"),
        ({"tools": [{"type": "retrieval"}]}, "tools", '"type": "function"'),
        ({"tools": [{"type": "function"}]}, "tools", "function must be an object"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters"),
        ({"tools": [TIME, TIME]}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "schema"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [TIME], "tool_choice": "always"}, "tool_choice", "one of"),
        (
            {"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
            "not among",
        ),
        ({"tools": [TIME], "tool_choice": {"type": "function"}}, "tool_choice", "must name"),
        ({"tools": [TIME], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(body, field, words):
    with pytest.raises(ProtocolError) as caught:
        tool_plan_of(body)
    assert caught.value.field == field and words in str(caught.value)


def test_required_calls_schema_accepts_valid_calls_only():
    plan = tool_plan_of({"tools": [WEATHER, TIME], "tool_choice": "required"})
    schema = plan.output_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(valid, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"unit": "C"}}],  # city missing
        [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "K"}}],  # $ref'd enum, lifted to the top
        [{"name": "nope", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_plan_of({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(valid, single.output_schema())
    assert plan.stream_parser() == "json_array"
    assert plan.read_reply(json.dumps(valid)).calls == (
        ToolCall("get_weather", '{"city": "Oslo", "unit": "C"}'),
        ToolCall("now", "{}"),
    )


def test_clashing_definitions_are_a_400():
    other = json.loads(json.dumps(WEATHER))
    other["function"]["name"] = "other"
    other["function"]["parameters"]["$defs"]["unit"] = {"enum": ["K"]}
    with pytest.raises(ProtocolError, match="differently"):
        tool_plan_of({"tools": [WEATHER, other], "tool_choice": "required"}).output_schema()


def test_a_named_function_makes_the_reply_its_arguments():
    plan = tool_plan_of({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "now"}}})
    assert plan.output_schema() == {"type": "object", "properties": {}}
    assert plan.stream_parser() is None
    assert plan.read_reply("{}") == ParsedReply(None, (ToolCall("now", "{}"),))


def test_auto_without_parallel_keeps_the_first_call_and_none_is_text():
    two = (
        '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    plan = tool_plan_of({"tools": [TIME], "parallel_tool_calls": False})
    assert plan.read_reply(two).calls == (ToolCall("now", "{}"),)
    none = tool_plan_of({"tools": [TIME], "tool_choice": "none"})
    assert none.read_reply(two) == ParsedReply(two)


def test_templates_with_tools_get_object_arguments():
    assert template_uses_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_uses_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    history = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": '{"a": 1}'}}],
        }
    ]
    assert messages_for_template(history)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_the_generic_rendering_lists_tools_and_writes_the_history_in_tags():
    plan = tool_plan_of({"tools": [TIME]})
    history = [
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    out = generic_tool_messages(history, plan)
    assert out[0]["role"] == "system" and '"name": "now"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[1] == {"role": "user", "content": "time?"}
    assert out[2] == {"role": "assistant", "content": '<tool_call>{"name": "now", "arguments": {}}</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.tool_calls %} CALLS {{ m.tool_calls[0].function.arguments.a }}{% endif %}\n{% endfor %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def test_the_renderer_passes_tools_to_a_template_that_uses_them():
    plan = tool_plan_of({"tools": [TIME]})
    history = [
        {"role": "user", "content": "t?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": '{"a": 7}'}}],
        },
    ]
    text = ChatRenderer(TOOL_TEMPLATE).render(history, tools=plan)
    assert text.startswith('TOOLS [{"type": "function", "function": {"name": "now"}}]')
    assert "assistant:  CALLS 7" in text


def test_the_renderer_writes_tools_generically_without_such_a_template():
    plan = tool_plan_of({"tools": [TIME]})
    for renderer in (ChatRenderer(PLAIN_TEMPLATE), ChatRenderer(None)):
        text = renderer.render([{"role": "user", "content": "t?"}], tools=plan)
        assert "<tools>" in text and '"name": "now"' in text and text.index("<tools>") < text.index("t?")
    assert "<tools>" not in ChatRenderer(PLAIN_TEMPLATE).render([{"role": "user", "content": "t?"}])

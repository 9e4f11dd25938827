"""Tool calls found in a reply: the formats' examples, and the stream's deltas reassembling to the
non-streamed result for every split of the text into chunks (hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from dist_infer.serving.http.tool_call_parsing import (
    ParsedReply,
    ToolCall,
    ToolCallStream,
    parse_reply,
    scan_object,
)


def test_hermes_calls_and_the_text_around_them():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
        '</tool_call>\n<tool_call>{"arguments": {"q": "a \\"}\\" b"}, "name": "search"}</tool_call>'
    )
    assert parse_reply(text, "hermes") == ParsedReply(
        "Let me check.",
        (
            ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}'),
            ToolCall("search", '{"q": "a \\"}\\" b"}'),
        ),
    )


def test_hermes_arguments_written_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_reply(text, "hermes").calls == (ToolCall("f", '{"x": 1}'),)


def test_hermes_without_calls_is_text_and_so_is_a_block_that_names_none():
    assert parse_reply("  just text <tool", "hermes") == ParsedReply("just text <tool")
    assert parse_reply('a <tool_call>{"nam', "hermes") == ParsedReply('a <tool_call>{"nam')
    assert parse_reply("a <tool_call> not json", "hermes") == ParsedReply("a <tool_call> not json")
    assert parse_reply("   ", "hermes") == ParsedReply(None)


def test_a_reply_cut_short_keeps_its_named_call_with_partial_arguments():
    reply = parse_reply('<tool_call>{"name": "f", "arguments": {"a": [1, 2', "hermes")
    assert reply == ParsedReply(None, (ToolCall("f", '{"a": [1, 2', complete=False),))
    assert parse_reply('<tool_call>{"name": "g"}</tool_call>', "hermes").calls == (ToolCall("g", "{}"),)


def test_llama3_json_calls_after_the_python_tag_or_alone():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert parse_reply(text, "llama3_json") == ParsedReply(None, (ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")))
    assert parse_reply(' {"name": "a", "arguments": {"y": null}}', "llama3_json").calls == (
        ToolCall("a", '{"y": null}'),
    )
    assert parse_reply("The answer is 4.", "llama3_json") == ParsedReply("The answer is 4.")
    assert parse_reply("{not a call}", "llama3_json") == ParsedReply("{not a call}")


def test_the_required_array_of_calls():
    text = '[{"name": "a", "parameters": {"x": [1]}}, {"name": "b", "parameters": {}}]'
    assert parse_reply(text, "json_array") == ParsedReply(None, (ToolCall("a", '{"x": [1]}'), ToolCall("b", "{}")))
    assert parse_reply("no array", "json_array") == ParsedReply("no array")


def test_scan_object_marks_values_of_the_top_level_keys_only():
    text = '{"a": {"name": 1}, "name" : "x" , "b": [1, "]"]}'
    scan = scan_object(text, 0)
    assert scan.end == len(text)
    assert {k: text[s:e].rstrip() for k, (s, e) in scan.fields.items()} == {
        "a": '{"name": 1}',
        "name": '"x"',
        "b": '[1, "]"]',
    }
    partial = scan_object('{"name": "x", "arguments": {"k": "v', 0)
    assert partial.end is None and partial.fields["arguments"][1] is None


def _streamed(text: str, cuts: list[int], parser: str) -> ParsedReply:
    stream = ToolCallStream(parser)
    content, names, args = "", {}, {}
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    results = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for delta, calls in results:
        content += delta
        for call in calls:
            if call.name is not None:
                assert call.index == len(names), "calls are named in order, once each"
                names[call.index] = call.name
            else:
                assert call.index in names, "arguments only after their call's name"
                args[call.index] = args.get(call.index, "") + call.arguments
    return ParsedReply(content or None, tuple(ToolCall(names[i], args.get(i, "")) for i in sorted(names)))


def _comparable(reply: ParsedReply) -> ParsedReply:
    return ParsedReply(reply.content, tuple(ToolCall(c.name, c.arguments) for c in reply.calls))


_ARGS = st.recursive(
    st.none() | st.booleans() | st.integers(-99, 99) | st.text(alphabet='ab "\\}{;<>', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet="xyz", max_size=2), inner, max_size=3),
    max_leaves=6,
)
_CALL = st.builds(
    lambda name, args, spaces, as_string: json.dumps(
        {"name": name, "arguments": json.dumps(args) if as_string else args}, indent=spaces
    ),
    st.text(alphabet="fgh_", min_size=1, max_size=5),
    st.dictionaries(st.text(alphabet="pq", max_size=2), _ARGS, max_size=3),
    st.sampled_from([None, 1]),
    st.booleans(),
)
_TEXT = st.text(alphabet="ab <>/_lo{}\n", max_size=12)


@st.composite
def hermes_replies(draw):
    parts = [draw(_TEXT)]
    for _ in range(draw(st.integers(0, 3))):
        parts += [f"<tool_call>{draw(st.sampled_from(['', chr(10)]))}{draw(_CALL)}</tool_call>", draw(_TEXT)]
    text = "".join(parts)
    return text[: draw(st.integers(0, len(text)))] if draw(st.booleans()) else text  # cut short sometimes


@st.composite
def llama3_replies(draw):
    calls = [draw(_CALL) for _ in range(draw(st.integers(1, 3)))]
    text = draw(st.sampled_from(["", "<|python_tag|>", " "])) + "; ".join(calls)
    text = draw(st.sampled_from([text, draw(_TEXT)]))
    return text[: draw(st.integers(0, len(text)))] if draw(st.booleans()) else text


@st.composite
def array_replies(draw):
    calls = [draw(_CALL).replace('"arguments"', '"parameters"') for _ in range(draw(st.integers(1, 3)))]
    text = "[" + ", ".join(calls) + "]"
    return text[: draw(st.integers(0, len(text)))] if draw(st.booleans()) else text


@pytest.mark.parametrize(
    "parser, replies",
    [("hermes", hermes_replies()), ("llama3_json", llama3_replies()), ("json_array", array_replies())],
)
def test_streamed_deltas_reassemble_to_the_whole_reply_for_every_chunking(parser, replies):
    @settings(max_examples=300, deadline=None)
    @given(text=replies, cuts=st.lists(st.integers(0, 400), max_size=30))
    def check(text, cuts):
        assert _streamed(text, cuts, parser) == _comparable(parse_reply(text, parser))

    check()


def test_complete_calls_carry_arguments_that_parse_as_the_json_written():
    args = {"city": "Zürich", "n": [1, {"deep": None}]}
    text = f"<tool_call>{json.dumps({'name': 'f', 'arguments': args}, ensure_ascii=False)}</tool_call>"
    (call,) = parse_reply(text, "hermes").calls
    assert call.complete and json.loads(call.arguments) == args

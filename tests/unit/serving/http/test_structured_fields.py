"""Every body form that asks for structure becomes one StructuredSpec; wrong shapes, two forms at
once and values past the bounds are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from dist_infer.engine.structured.spec import MAX_CHOICES, MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, StructuredSpec
from dist_infer.serving.http.json_body import ProtocolError
from dist_infer.serving.http.structured_fields import json_depth, structured_spec_of

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
CANONICAL = json.dumps(SCHEMA, separators=(",", ":"))  # the schema's key order is the output's: kept


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA, indent=2)},
        {"structured_outputs": {"json": SCHEMA}},
    ],
)
def test_each_schema_form_is_the_same_canonical_spec(body):
    assert structured_spec_of(body) == StructuredSpec(kind="json_schema", value=CANONICAL)


@pytest.mark.parametrize(
    "body, kind, value",
    [
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        ({"structured_outputs": {"json_object": True}}, "json_object", ""),
        ({"guided_regex": r"\d{3}"}, "regex", r"\d{3}"),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
        ({"guided_choice": ["yes", "no"]}, "choice", '["yes","no"]'),
        ({"structured_outputs": {"choice": ["é"]}}, "choice", '["é"]'),
        ({"guided_grammar": 'start: "a"'}, "lark", 'start: "a"'),
        ({"guided_grammar": 'root ::= "a"'}, "ebnf", 'root ::= "a"'),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "ebnf", 'root ::= "a"'),
    ],
)
def test_the_other_forms(body, kind, value):
    assert structured_spec_of(body) == StructuredSpec(kind=kind, value=value)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"response_format": None},
        {"response_format": {"type": "text"}},
        {"guided_json": None, "structured_outputs": None},
        {"structured_outputs": {"json_object": False}},
        {"guided_decoding_backend": "auto"},
    ],
)
def test_nothing_asked_is_free_text(body):
    assert structured_spec_of(body) is None


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "send one"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex", "send one"),
        ({"response_format": "json"}, "response_format", '"type"'),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format", "int"),
        ({"response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}}, "response_format", "strict"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1]"}, "guided_json", "JSON object"),
        ({"guided_json": [1]}, "guided_json", "list"),
        ({"guided_regex": ""}, "guided_regex", "non-empty"),
        ({"guided_regex": 7}, "guided_regex", "string"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "strings"),
        ({"guided_choice": ["a"] * (MAX_CHOICES + 1)}, "guided_choice", "at most"),
        ({"guided_choice": ["a" * 2000]}, "guided_choice", "at most"),
        ({"guided_grammar": "x" * (MAX_SPEC_CHARS + 1)}, "guided_grammar", "characters"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs", "boolean"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
        ({"structured_outputs": []}, "structured_outputs", "object"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
    ],
)
def test_bad_requests_name_their_field(body, field, words):
    with pytest.raises(ProtocolError) as caught:
        structured_spec_of(body)
    assert caught.value.field == field.split(".")[0] or caught.value.field == field
    assert words in str(caught.value)


def test_a_schema_nested_past_the_bound_is_refused_without_recursion():
    deep: dict = {"type": "integer"}
    for _ in range(5000):  # past Python's recursion limit: the check must not recurse
        deep = {"type": "array", "items": deep}
    assert json_depth(deep) == 5001
    with pytest.raises(ProtocolError) as caught:
        structured_spec_of({"guided_json": deep})
    assert f"at most {MAX_SCHEMA_DEPTH}" in str(caught.value)


def test_a_schema_too_long_as_json_is_refused():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SPEC_CHARS // 16)}}
    with pytest.raises(ProtocolError, match="characters"):
        structured_spec_of({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": wide}}})


def test_json_depth_counts_containers_only():
    assert json_depth(3) == 0
    assert json_depth({}) == 1
    assert json_depth({"a": [1, {"b": []}]}) == 4

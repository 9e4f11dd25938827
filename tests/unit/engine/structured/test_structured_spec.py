"""StructuredSpec: one canonical text per spec (so equal requests share a cache key), every bad spec
refused by name when it is made, and each kind turned into an llguidance grammar."""

from __future__ import annotations

import json
import pickle

import pytest

from dist_infer.engine.request import RequestError
from dist_infer.engine.sampling import SamplingParams, SamplingParamsError
from dist_infer.engine.structured.spec import (
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    StructuredSpec,
    StructuredSpecError,
    choice_lark,
)


def test_a_schema_is_canonical_json_whatever_its_spacing_but_keeps_its_key_order():
    a = StructuredSpec("json_schema", '{ "type": "object",  "properties": {"b": {"type": "integer"}} }')
    b = StructuredSpec.from_kind("json_schema", {"type": "object", "properties": {"b": {"type": "integer"}}})
    assert a == b and a.key() == b.key() and a.value == '{"type":"object","properties":{"b":{"type":"integer"}}}'
    assert a.key() != StructuredSpec("regex", a.value).key(), "the kind is part of the key"
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    ba = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    one, other = StructuredSpec.from_kind("json_schema", ab), StructuredSpec.from_kind("json_schema", ba)
    assert one.key() != other.key(), "llguidance writes properties in the schema's order: two grammars"


def test_a_choice_is_a_json_list_and_json_object_has_no_text():
    c = StructuredSpec.from_kind("choice", ["yes", "no"])
    assert c.value == '["yes","no"]' and c == StructuredSpec("choice", '[ "yes", "no" ]')
    assert StructuredSpec.from_kind("json_object").value == ""
    assert StructuredSpec("json_object", "ignored").value == ""


@pytest.mark.parametrize(
    "kind,value,field,needle",
    [
        ("yaml", "x", "structured", "kind must be one of"),
        ("json_schema", "{not json", "json_schema", "not valid JSON"),
        ("json_schema", "[1, 2]", "json_schema", "must be a JSON object"),
        ("choice", "[]", "choice", "non-empty list of strings"),
        ("choice", '["a", 1]', "choice", "non-empty list of strings"),
        ("choice", '"a"', "choice", "non-empty list of strings"),
        ("regex", "", "regex", "empty"),
        ("lark", "", "lark", "empty"),
        ("regex", 5, "regex", "must be given as text"),
        ("lark", "x" * (MAX_SPEC_CHARS + 1), "lark", "characters, more than"),
        ("json_schema", '{"a":' * (MAX_SCHEMA_DEPTH + 1) + "1" + "}" * (MAX_SCHEMA_DEPTH + 1), "json_schema", "deeper"),
        ("choice", json.dumps(["a"] * (MAX_CHOICES + 1)), "choice", "at most"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(kind, value, field, needle):
    with pytest.raises(StructuredSpecError, match=needle) as info:
        StructuredSpec(kind, value)
    assert info.value.field == field
    assert isinstance(info.value, RequestError), "a RequestError: a 400 naming its field wherever those are"


def test_from_kind_refuses_what_a_body_cannot_hold():
    with pytest.raises(StructuredSpecError, match="JSON object") as info:
        StructuredSpec.from_kind("json_schema", ["a"])
    assert info.value.field == "json_schema"
    with pytest.raises(StructuredSpecError, match="cannot be written as JSON"):
        StructuredSpec.from_kind("choice", [object()])


def test_a_deep_schema_is_refused_without_recursion_errors():
    deep = '{"a":' * 40_000 + "1" + "}" * 40_000  # within the size limit, far past Python's recursion limit
    with pytest.raises(StructuredSpecError, match="deep"):
        StructuredSpec("json_schema", deep)


def test_sampling_params_take_a_spec_and_refuse_anything_else():
    spec = StructuredSpec.from_kind("regex", "[a-z]+")
    params = SamplingParams(structured=spec)
    assert pickle.loads(pickle.dumps(params)) == params, "it travels with the request"
    assert SamplingParams().structured is None
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured={"type": "object"})
    assert info.value.field == "structured"


def test_choice_literals_are_quoted_so_any_text_is_one_literal():
    tricky = ['say "hi"', "back\\slash", "new\nline", "a | b", "/re/", "%json", ""]
    assert choice_lark(tricky) == "start: " + " | ".join(json.dumps(c) for c in tricky)


def test_every_kind_becomes_an_llguidance_grammar():
    from llguidance import LLMatcher

    specs = [
        StructuredSpec.from_kind("json_schema", {"type": "integer"}),
        StructuredSpec.from_kind("json_object"),
        StructuredSpec.from_kind("regex", "[0-9]{3}"),
        StructuredSpec.from_kind("choice", ["a", "b"]),
        StructuredSpec.from_kind("lark", 'start: "x"+'),
        StructuredSpec.from_kind("ebnf", 'root ::= "a" | "b"'),
    ]
    for spec in specs:
        assert LLMatcher.validate_grammar(spec.to_grammar()) == "", spec
    compact = json.loads(specs[0].to_grammar())["grammars"][0]["json_schema"]["x-guidance"]
    assert compact == {"whitespace_flexible": False}, "compact JSON unless the schema says otherwise"


def test_an_ebnf_grammar_the_converter_cannot_read_is_refused():
    with pytest.raises(StructuredSpecError, match="cannot be converted") as info:
        StructuredSpec.from_kind("ebnf", "root ::= missing").to_grammar()
    assert info.value.field == "ebnf"

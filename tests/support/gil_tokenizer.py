"""A tokenizer whose encode holds the GIL for a set time, as `tokenizers`' Rust encode of a long
prompt does (a thread running it stops every other thread of the process), with no CPU spent:
the wait is libc's usleep called through ctypes.PyDLL, which keeps the GIL. Picklable, so the
API's worker processes can load it."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from tests.support.fake_engine import FakeTokenizer


@dataclass
class Encoding:
    ids: list[int]


@dataclass
class GilHoldingBackend:
    hold_s: float

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        ctypes.PyDLL(None).usleep(int(self.hold_s * 1_000_000))
        return Encoding(FakeTokenizer().encode(text, add_bos=False))


class GilHoldingTokenizer(FakeTokenizer):
    """FakeTokenizer's ids (one per character, so one character per token), encoded by a backend
    that holds the GIL for `hold_s`: in this process (encode) or in a worker (backend)."""

    max_chars_per_token = 1

    def __init__(self, hold_s: float):
        self.backend = GilHoldingBackend(hold_s)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.with_bos(self.backend.encode(text).ids, add_bos)

    def with_bos(self, ids: list[int], add_bos: bool = True) -> list[int]:
        return [self.bos_id] + ids if add_bos else ids

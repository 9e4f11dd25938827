"""A tokenizer whose encode holds the GIL until the test lets it go, as `tokenizers`' Rust encode of
a long prompt holds it (a thread running it stops every other thread of its process), with no CPU
spent: the encode waits inside one libc `system()` call made through ctypes.PyDLL, which keeps the
GIL. The shell it runs first marks the encode as started (`started.<pid>` in the gate folder), then
waits for `released` there. Picklable, so the API's worker processes can load it."""

from __future__ import annotations

import ctypes
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.support.fake_engine import FakeTokenizer


@dataclass
class Encoding:
    ids: list[int]


@dataclass
class GilHoldingBackend:
    gate: str  # a folder: the encodes mark themselves started in it and wait for `released`

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        gate = shlex.quote(self.gate)
        ctypes.PyDLL(None).system(
            f"touch {gate}/started.$$; while [ ! -e {gate}/released ]; do sleep 0.02; done".encode()
        )
        return Encoding(FakeTokenizer().encode(text, add_bos=False))


class GilHoldingTokenizer(FakeTokenizer):
    """FakeTokenizer's ids (one per character, so one character per token), encoded by a backend
    that holds the GIL until the gate opens: in this process (encode) or in a worker (backend)."""

    max_chars_per_token = 1

    def __init__(self, gate: Path):
        self.backend = GilHoldingBackend(str(gate))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.with_bos(self.backend.encode(text).ids, add_bos)

    def with_bos(self, ids: list[int], add_bos: bool = True) -> list[int]:
        return [self.bos_id] + ids if add_bos else ids

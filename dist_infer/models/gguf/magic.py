"""Telling a GGUF file by its name or first bytes; torch-free so `dist-infer plan` can ask before
deciding whether it needs the (torch) GGUF reader."""

from __future__ import annotations

import os
from pathlib import Path

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | os.PathLike) -> bool:
    """A path names a GGUF file when it ends in .gguf (what users type) or starts with its magic."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC

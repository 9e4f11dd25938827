"""Hostile GGUF files for the loader's checks: a small valid file (gguf_files.write_llama_gguf) with
one header number rewritten in place, the way a damaged or malicious download would differ.

The gguf package's reader, opened read-write, maps each header number to its bytes in the file, so
`patch_field` and `patch_tensor_dims` change exactly those bytes and nothing else.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Union

from gguf_files import write_llama_gguf

SMALL = dict(qtype="F32", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=64, context=64)


def small_gguf(path: Union[str, Path]) -> Path:
    """A valid ~100 KB Llama GGUF (fp32), the base every hostile file is patched from."""
    return write_llama_gguf(path, **SMALL)


def hostile_copy(base: Path, path: Union[str, Path]) -> Path:
    path = Path(path)
    shutil.copyfile(base, path)
    return path


def patch_field(path: Path, key: str, value: int) -> Path:
    """Rewrite the number stored under metadata key `key` (or GGUF.tensor_count) in place."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value
    reader.data.flush()
    return path


def patch_tensor_dims(path: Path, name: str, dims: list[int]) -> Path:
    """Rewrite the dimensions (GGUF order: fastest first) of tensor `name`; same count as before."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    stored = tensor.field.parts[3]
    assert len(stored) == len(dims), f"{name} has {len(stored)} dimensions"
    stored[:] = dims
    reader.data.flush()
    return path


def patch_tensor_offset(path: Path, name: str, offset: int) -> Path:
    """Move tensor `name`'s data offset (from the start of the data section)."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    tensor.field.parts[5][0] = offset
    reader.data.flush()
    return path

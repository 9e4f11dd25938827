"""Hostile GGUF files for the loader's checks: a small valid file (gguf_files.write_llama_gguf) with
one header number rewritten in place, the way a damaged or malicious download would differ.

The gguf package's reader, opened read-write, maps each header number to its bytes in the file, so
`patch_field` and `patch_tensor_dims` change exactly those bytes and nothing else.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Union

from tests.support.gguf_files import write_llama_gguf

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


# -- the cases: name -> (patch, what the loader's error must say) -----------------------------------------


def _dims_4tb(p):
    return patch_tensor_dims(p, "token_embd.weight", [2**20, 2**20])  # 2**40 fp32 values: 4 TiB in a ~55 KB file


def _metadata_4tb(p):
    patch_field(p, "llama.embedding_length", 2**20)  # the model would allocate a 4 TiB embedding
    return patch_field(p, "llama.vocab_size", 2**20)


HOSTILE = {  # name -> (patch, what the error must say)
    "tensor-dims-claim-4TB": (
        _dims_4tb,
        r"token_embd.weight claims dims \[1048576, 1048576\]: 4398046511104 bytes .* "
        r"past the end of the \d+-byte file",
    ),
    "metadata-claims-4TB": (
        _metadata_4tb,
        r"token_embd.weight has shape \[32, 64\] but llama.vocab_size=1048576, "
        r"llama.embedding_length=1048576 needs \[1048576, 1048576\]",
    ),
    "head_count-0": (lambda p: patch_field(p, "llama.attention.head_count", 0), r"llama.attention.head_count is 0$"),
    "head_count_kv-0": (
        lambda p: patch_field(p, "llama.attention.head_count_kv", 0),
        r"llama.attention.head_count_kv is 0$",
    ),
    "head_count-not-a-multiple": (
        lambda p: patch_field(p, "llama.attention.head_count_kv", 3),
        r"head_count=2 is not a multiple of llama.attention.head_count_kv=3",
    ),
    "embedding_length-0": (lambda p: patch_field(p, "llama.embedding_length", 0), r"llama.embedding_length is 0$"),
    "block_count-0": (lambda p: patch_field(p, "llama.block_count", 0), r"llama.block_count is 0$"),
    "block_count-2**31": (
        lambda p: patch_field(p, "llama.block_count", 2**31),
        r"llama.block_count is 2147483648 but the file has no blk.1.attn_norm.weight",
    ),
    "context_length-2**31": (
        lambda p: patch_field(p, "llama.context_length", 2**31),
        r"llama.context_length is 2147483648, more than",
    ),
    "tensor-past-the-end": (
        lambda p: patch_tensor_offset(p, "output.weight", 10**6),
        r"output.weight claims dims \[32, 64\]: 8192 bytes from byte \d+, past the end",
    ),
    "tensor_count-2**40": (
        lambda p: patch_field(p, "GGUF.tensor_count", 2**40),
        r"GGUF.tensor_count is 1099511627776, but a file of \d+ bytes holds at most \d+",
    ),
}


def hostile_file(base: Path, directory: Path, case: str) -> Path:
    """A copy of `base` in `directory` with HOSTILE[case]'s patch applied."""
    return HOSTILE[case][0](hostile_copy(base, directory / "model.gguf"))

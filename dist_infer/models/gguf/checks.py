"""Checks that make an untrusted GGUF file fail fast, with an error naming the file and the field or
tensor, before anything is allocated from the numbers in its header.

A GGUF header is a list of claims (counts, dimensions, offsets, head counts); a damaged or hostile
file can claim 2**40 tensors, a 4 TB tensor in a 77 KB file, or zero attention heads. Each claim is
checked here against what can hold it: counts against the file size, each tensor's bytes against
the end of the file, header numbers against zero and each other, and each tensor's shape against
the shape the model builds from the metadata (so the model never allocates for a size the file's
own tensors do not have). Pure functions; the reader and the checkpoint call them.
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import Any

from dist_infer.models.checkpoint import CheckpointError

MAX_POSITIONS = 2**24  # context_length above this would size rotary tables of many GiB
MIN_TENSOR_INFO_BYTES = 24  # name length 8 + dimension count 4 + type 4 + offset 8 (no name, no dims)
MIN_KV_BYTES = 13  # key length 8 + value type 4 + a one-byte value
HEADER_BYTES = 24  # magic 4 + version 4 + tensor count 8 + metadata count 8


class TensorExtentError(ValueError):
    """A tensor's bytes do not lie inside the file (raised while parsing, before any tensor is mapped)."""


def check_header_counts(path: Any, head: bytes, file_size: int) -> None:
    """The tensor and metadata counts of the header, against how many entries the file can hold."""
    if len(head) < HEADER_BYTES:
        raise CheckpointError(f"{path}: {file_size} bytes, shorter than a GGUF header ({HEADER_BYTES} bytes)")
    order = ">" if struct.unpack_from("<I", head, 4)[0] & 0xFFFF == 0 else "<"  # the reader's byte-order rule
    tensors, kvs = struct.unpack_from(f"{order}QQ", head, 8)
    room = file_size - HEADER_BYTES
    if tensors > room // MIN_TENSOR_INFO_BYTES:
        raise CheckpointError(
            f"{path}: GGUF.tensor_count is {tensors}, but a file of {file_size} bytes holds at most "
            f"{room // MIN_TENSOR_INFO_BYTES} tensor entries"
        )
    if kvs > room // MIN_KV_BYTES:
        raise CheckpointError(
            f"{path}: GGUF.kv_count is {kvs}, but a file of {file_size} bytes holds at most "
            f"{room // MIN_KV_BYTES} metadata entries"
        )


def tensor_nbytes(name: str, dims: list[int], type_id: int) -> int | None:
    """Bytes a tensor of these GGUF dims and type takes (Python ints: no overflow), None for an unknown type."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        return None  # the reader names the unknown type itself
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if dims and dims[0] % block:
        raise TensorExtentError(
            f"{name} has {dims[0]} values per row, not a multiple of {qtype.name}'s {block}-value blocks"
        )
    return math.prod(dims) * block_bytes // block


def check_tensor_extent(name: str, dims: list[int], type_id: int, start: int, file_size: int) -> None:
    """Tensor `name` (data from byte `start` of the file) must end inside the file."""
    nbytes = tensor_nbytes(name, dims, type_id)
    if nbytes is not None and start + nbytes > file_size:
        raise TensorExtentError(
            f"{name} claims dims {dims}: {nbytes} bytes from byte {start}, past the end of the {file_size}-byte file"
        )


def _finite_real(value: Any) -> bool:
    """A finite real number, not a bool (numpy's scalars count: GGUF metadata reads as those)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def metadata_int(path: Any, key: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    """Metadata `key` as an int in [minimum, maximum], else a CheckpointError naming the file and key."""
    if not _finite_real(value) or value != int(value):
        raise CheckpointError(f"{path}: {key} is {str(value)[:60]!r}, not an integer")
    n = int(value)
    if n < minimum:
        raise CheckpointError(f"{path}: {key} is {n}" + (f", must be >= {minimum}" if minimum != 1 else ""))
    if maximum is not None and n > maximum:
        raise CheckpointError(f"{path}: {key} is {n}, more than the {maximum} this loader accepts")
    return n


def head_dim_of(path: Any, arch: str, hidden: int, heads: int, kv_heads: int, key_length: int | None) -> int:
    """The per-head width, after checking the head counts divide as attention needs."""
    if heads % kv_heads:
        raise CheckpointError(
            f"{path}: {arch}.attention.head_count={heads} is not a multiple of "
            f"{arch}.attention.head_count_kv={kv_heads}"
        )
    if key_length is None:
        if hidden % heads:
            raise CheckpointError(
                f"{path}: {arch}.embedding_length={hidden} is not divisible by {arch}.attention.head_count={heads}"
            )
        head_dim = hidden // heads
    else:
        head_dim = key_length
    if head_dim % 2:
        raise CheckpointError(
            f"{path}: the head width {head_dim} ({arch}.attention.key_length or embedding_length / "
            f"head_count) is odd; rotary embeddings need it even"
        )
    return head_dim


# HF name (after model.layers.N.) -> (the HF shape from the config, the GGUF metadata keys it comes from)
_SHAPES = {
    "model.embed_tokens.weight": (lambda c: (c["vocab_size"], c["hidden_size"]), ("vocab_size", "embedding_length")),
    "lm_head.weight": (lambda c: (c["vocab_size"], c["hidden_size"]), ("vocab_size", "embedding_length")),
    "model.norm.weight": (lambda c: (c["hidden_size"],), ("embedding_length",)),
    "input_layernorm.weight": (lambda c: (c["hidden_size"],), ("embedding_length",)),
    "post_attention_layernorm.weight": (lambda c: (c["hidden_size"],), ("embedding_length",)),
    "self_attn.q_proj.weight": (
        lambda c: (c["num_attention_heads"] * c["head_dim"], c["hidden_size"]),
        ("embedding_length", "attention.head_count", "head width"),
    ),
    "self_attn.k_proj.weight": (
        lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
        ("embedding_length", "attention.head_count_kv", "head width"),
    ),
    "self_attn.v_proj.weight": (
        lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
        ("embedding_length", "attention.head_count_kv", "head width"),
    ),
    "self_attn.o_proj.weight": (
        lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
        ("embedding_length", "attention.head_count", "head width"),
    ),
    "mlp.gate_proj.weight": (
        lambda c: (c["intermediate_size"], c["hidden_size"]),
        ("feed_forward_length", "embedding_length"),
    ),
    "mlp.up_proj.weight": (
        lambda c: (c["intermediate_size"], c["hidden_size"]),
        ("feed_forward_length", "embedding_length"),
    ),
    "mlp.down_proj.weight": (
        lambda c: (c["hidden_size"], c["intermediate_size"]),
        ("embedding_length", "feed_forward_length"),
    ),
}
_CONFIG_OF_KEY = {
    "vocab_size": "vocab_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "head width": "head_dim",
    "feed_forward_length": "intermediate_size",
}


def check_tensor_shape(path: Any, arch: str, gguf_name: str, hf_name: str, gguf_dims: list[int], config: dict) -> None:
    """A tensor's dims must be the ones the model builds from the metadata (shapes in GGUF order)."""
    rule = hf_name if hf_name in _SHAPES else hf_name.split(".", 3)[3]
    shape_of, keys = _SHAPES[rule]
    want = list(reversed(shape_of(config)))
    if list(gguf_dims) != want:
        why = ", ".join(f"{k if k == 'head width' else f'{arch}.{k}'}={config[_CONFIG_OF_KEY[k]]}" for k in keys)
        raise CheckpointError(f"{path}: {gguf_name} has shape {list(gguf_dims)} but {why} needs {want}")


def layer_tensor_names(layer: int) -> list[str]:
    """The GGUF names every decoder layer must have."""
    return [
        f"blk.{layer}.{n}"
        for n in (
            "attn_norm.weight",
            "ffn_norm.weight",
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_output.weight",
            "ffn_gate.weight",
            "ffn_up.weight",
            "ffn_down.weight",
        )
    ]


def check_layers_present(path: Any, arch: str, blocks: int, present: set[str]) -> None:
    """Every layer the metadata counts has all its tensors (stops at the first gap: block_count may be 2**32)."""
    for layer in range(blocks):
        missing = [n for n in layer_tensor_names(layer) if n not in present]
        if missing:
            raise CheckpointError(f"{path}: {arch}.block_count is {blocks} but the file has no {missing[0]}")

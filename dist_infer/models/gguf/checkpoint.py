"""A GGUF file (llama.cpp's format) read as a checkpoint: the same interface as `Checkpoint`.

The file's metadata becomes a HF-style config, its tensors are offered under HF names, and each
tensor is lazy: a rank that narrows it to its shard dequantizes only that shard. Quantized
tensors are stored row by row in blocks along the input dimension (Q4_1: 32 values in 20
bytes), so
- a row shard (column-parallel layers: q/k/v, gate/up, the vocabulary) reads just its rows;
- a column shard (row-parallel layers: o_proj, down_proj) reads, in every row, the blocks that
  overlap its columns. A shard boundary inside a block costs the two ranks that share it one
  extra block each per row; the values are the same either way, since each block dequantizes
  alone.
The `gguf` package reads the file (memory-mapped) and dequantizes the blocks. A layer that keeps
its weight quantized reads it with `quantized_slice` instead: the same rows and blocks, as integers
and per-group scales (gguf_quant), never as a float weight.

llama.cpp stores the q and k projections of Llama models with each head's rows interleaved
(its converter permutes them for its rotary kernel); the row map here undoes that, so the
weights equal the HF checkpoint's.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loguru import logger

from dist_infer.models.checkpoint import CheckpointError, TensorIndex, return_freed_memory
from dist_infer.models.gguf.checks import (
    MAX_POSITIONS,
    TensorExtentError,
    check_header_counts,
    check_layers_present,
    check_tensor_shape,
    head_dim_of,
    metadata_int,
)
from dist_infer.models.gguf.magic import GGUF_MAGIC, is_gguf  # noqa: F401 (loader, tokenizer import it from here)
from dist_infer.models.gguf.quant import (
    EXACT_BITS,
    GROUP,
    REQUANT_BITS,
    blocks_to_weight,
    quantization_error,
    quantization_of_type,
    requantize,
)
from dist_infer.models.gguf.reader import ArrayField, lean_reader_class
from dist_infer.parallel.quantized import QuantizedWeight

# Types whose dequantization is implemented by the gguf package and checked here.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
ARCHITECTURES = ("llama",)

_LAYER_NAMES = {  # GGUF blk.N.<name> -> HF model.layers.N.<name>
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name of a GGUF tensor name, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """GGUF row index of each HF row of a llama q or k projection.

    llama.cpp stores head h's rows as (d/2 pairs) x (2 halves) where HF has (2 halves) x (d/2):
    HF row h*d + half*(d/2) + j is GGUF row h*d + 2j + half."""
    d = n_rows // n_heads
    r = np.arange(n_rows)
    head, within = divmod(r, d)
    half, j = divmod(within, d // 2)
    return head * d + 2 * j + half


def open_reader(path: Path):
    """The parsed file (memory-mapped; metadata arrays such as the vocabulary decoded only when read, see
    gguf_reader). Inside a `shared_parses()` block each file is parsed once for every reader of it;
    outside one, each caller gets its own parse, dropped with it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(24)
    magic = head[:4]
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
    stat = path.stat()
    check_header_counts(path, head, stat.st_size)
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    shared = _SHARED_PARSES.get()
    if shared is None:
        return _parse(key[0])
    if key not in shared:
        shared[key] = _parse(key[0])
    return shared[key]


# The parses shared inside the outermost `shared_parses()` block of this context (None: no block).
_SHARED_PARSES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("gguf_shared_parses", default=None)


@contextlib.contextmanager
def shared_parses():
    """Parse each GGUF file once for all its readers inside the block: a rank reads its file for the
    weights and again for the tokenizer. When the block ends the parses go, and with them the memory
    maps (the parse itself holds no per-entry arrays: gguf_reader leaves the vocabulary undecoded)."""
    if _SHARED_PARSES.get() is not None:  # nested: the outer block owns the parses
        yield
        return
    token = _SHARED_PARSES.set({})
    try:
        yield
    finally:
        _SHARED_PARSES.reset(token)
        return_freed_memory()


def _parse(path: str):
    try:
        return lean_reader_class()(path, "r")
    except TensorExtentError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on damaged files
        raise CheckpointError(
            f"cannot read GGUF file {path} (truncated or damaged?): {type(exc).__name__}: {exc}"
        ) from exc


def read_field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


class GGUFTensor:
    """One tensor of a GGUF file under its HF name and HF shape ([out, in] for a matrix).

    Indexing with slices (what `narrow` does) dequantizes only the selected rows and the blocks
    covering the selected columns, to fp32."""

    def __init__(self, path: Path, tensor, name: str, row_map: np.ndarray | None = None):
        import gguf

        self.path, self._t, self.name, self._row_map = path, tensor, name, row_map
        self.gguf_name = tensor.name
        self.type_name = tensor.tensor_type.name
        self.shape = tuple(int(d) for d in reversed([int(x) for x in tensor.shape]))
        self.dtype = torch.float32
        self._qtype = tensor.tensor_type
        self._block, self._block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        self._dequantize = gguf.quants.dequantize
        self.requantization_error: tuple[float, float] | None = None  # (max abs, relative RMS)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"GGUFTensor({self.name!r} <- {self.gguf_name!r}, {self.type_name}, shape={list(self.shape)})"

    def _raw_rows(self) -> np.ndarray:
        """The tensor's bytes as [rows, bytes per row] (a view of the memory map)."""
        rows = int(np.prod(self.shape[:-1])) if self.ndim > 1 else 1
        return np.asarray(self._t.data).reshape(-1).view(np.uint8).reshape(rows, -1)

    def _rows(self, rows: slice) -> np.ndarray:
        """The stored rows of the HF rows `rows` (through the row map)."""
        if self.ndim == 1:
            return np.array([0])
        picked = np.arange(self.shape[0])[rows]
        return picked if self._row_map is None else self._row_map[picked]

    def _blocks(self, rows: np.ndarray, b0: int, b1: int) -> np.ndarray:
        """Blocks b0..b1-1 of the stored rows `rows`: a copy of just those bytes, [len(rows), bytes]."""
        raw = self._raw_rows()
        expected = (self.shape[-1] // self._block) * self._block_bytes
        if raw.shape[1] != expected:
            raise CheckpointError(
                f"{self.path}: tensor {self.gguf_name!r} ({self.type_name}) has {raw.shape[1]} bytes "
                f"per row, expected {expected}"
            )
        return np.ascontiguousarray(raw[rows, b0 * self._block_bytes : b1 * self._block_bytes])

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        if len(index) != self.ndim or not all(isinstance(s, slice) and s.step in (None, 1) for s in index):
            raise CheckpointError(f"{self.name}: only contiguous slices are supported, got {index}")
        c0, c1, _ = index[-1].indices(self.shape[-1])
        rows = self._rows(index[0])
        b0, b1 = c0 // self._block, -(-c1 // self._block)
        picked = self._blocks(rows, b0, b1)
        try:
            values = self._dequantize(picked, self._qtype)
        except Exception as exc:
            raise CheckpointError(
                f"{self.path}: cannot dequantize tensor {self.gguf_name!r} of type {self.type_name}: {exc}"
            ) from exc
        values = values.reshape(len(rows), -1)[:, c0 - b0 * self._block : c1 - b0 * self._block]
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        return out[0] if self.ndim == 1 else out

    @property
    def quantization(self) -> str | None:
        """ "int8" / "int4": what `quantized_slice` gives; None: a float tensor (index it instead)."""
        return quantization_of_type(self.type_name) if self.ndim == 2 else None

    def quantized_slice(self, rows: slice = slice(None), cols: slice = slice(None)) -> QuantizedWeight | None:
        """[rows, cols] of this matrix kept as integers with per-group scales, or None for a float tensor.

        Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K blocks convert as stored (only the asked rows'
        blocks covering `cols` are read); Q2_K, Q3_K and Q6_K are dequantized and requantized
        (gguf_quant), the error logged once a tensor. `cols` must start on a 32-value group boundary,
        so every group is one of the file's own (a ValueError otherwise: the caller reads floats)."""
        if self.quantization is None:
            return None
        if not all(isinstance(s, slice) and s.step in (None, 1) for s in (rows, cols)):
            raise CheckpointError(f"{self.name}: only contiguous slices are supported, got {(rows, cols)}")
        c0, c1, _ = cols.indices(self.shape[1])
        if c0 % GROUP:
            raise CheckpointError(
                f"{self.name}: columns {c0}..{c1} start inside a {GROUP}-value group of "
                f"{self.type_name}; a quantized shard must start on a group boundary"
            )
        if self.type_name in EXACT_BITS:
            b0, b1 = c0 // self._block, -(-c1 // self._block)
            picked = self._blocks(self._rows(rows), b0, b1)
            return blocks_to_weight(picked, self.type_name, c0 - b0 * self._block, c1 - c0)
        values = self[rows, slice(c0, c1)]
        bits = REQUANT_BITS[self.type_name]
        weight = requantize(values, bits, GROUP)
        if self.requantization_error is None:  # measured on the first shard read; every shard is alike
            self.requantization_error = quantization_error(values, weight)
            logger.info(
                f"{self.gguf_name} ({self.type_name}) requantized to int{bits} per {GROUP}: max abs error "
                f"{self.requantization_error[0]:.3g}, relative RMS {self.requantization_error[1]:.3g}"
            )
        return weight


class GGUFCheckpoint(TensorIndex):
    """A .gguf file as a checkpoint: `config` (HF-style), `tensor(name)`, `has`, `names`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._reader = open_reader(self.path)
        r = self._reader
        arch = read_field(r, "general.architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; expected one of {ARCHITECTURES}"
            )
        self.config = gguf_config(r, self.path)
        self.arch = arch
        self._index: dict[str, GGUFTensor] = {}
        for t in r.tensors:
            name = hf_name(t.name)
            if name is not None and self._used(name):
                self._index[name] = self._indexed(t, name)
        present = {t.gguf_name for t in self._index.values()}
        check_layers_present(self.path, arch, self.config["num_hidden_layers"], present)
        self.config["tie_word_embeddings"] = "lm_head.weight" not in self._index
        if "model.embed_tokens.weight" not in self._index:
            raise CheckpointError(f"{self.path}: no token_embd.weight tensor (is the file complete?)")
        if "model.norm.weight" not in self._index:
            raise CheckpointError(f"{self.path}: no output_norm.weight tensor (is the file complete?)")

    def _used(self, name: str) -> bool:
        """Whether the model reads this tensor: not the layers past block_count."""
        parts = name.split(".")
        return parts[1] != "layers" or int(parts[2]) < self.config["num_hidden_layers"]

    def _indexed(self, t, name: str) -> GGUFTensor:
        """Tensor `t` under its HF name, once its type and shape are what the model expects."""
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, which this "
                f"loader does not dequantize; supported: {', '.join(SUPPORTED_TYPES)}"
            )
        check_tensor_shape(self.path, self.arch, t.name, name, [int(d) for d in t.shape], self.config)
        row_map = None
        if name.endswith("self_attn.q_proj.weight"):
            row_map = unpermute_rows(int(t.shape[1]), self.config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            row_map = unpermute_rows(int(t.shape[1]), self.config["num_key_value_heads"])
        return GGUFTensor(self.path, t, name, row_map)

    @property
    def quantization(self) -> str | None:
        """What the file's matrices hold, by most values: "int8" / "int4" (as `quantized_slice` gives them), or
        None for float matrices; lets `--quantization auto` keep the file's own."""
        counts: dict[str | None, int] = {}
        for t in self._index.values():
            if t.ndim == 2:
                counts[t.quantization] = counts.get(t.quantization, 0) + t.shape[0] * t.shape[1]
        return max(counts, key=counts.__getitem__) if counts else None

    def requantization_report(self) -> str | None:
        """One line on the tensors `quantized_slice` requantized so far (their largest errors), None if none."""
        errors = {t.gguf_name: t.requantization_error for t in self._index.values() if t.requantization_error}
        if not errors:
            return None
        worst = max(errors, key=lambda n: errors[n][1])
        return (
            f"{len(errors)} tensors requantized per {GROUP} values: largest abs error "
            f"{max(e[0] for e in errors.values()):.3g}, largest relative RMS error {errors[worst][1]:.3g} ({worst})"
        )

    def tensor(self, name: str) -> GGUFTensor:
        t = self._index.get(name)
        if t is None:
            raise CheckpointError(f"tensor {name!r} not found in GGUF file {self.path}")
        return t

    @property
    def files(self) -> list[Path]:
        return [self.path]

    def close(self) -> None:
        self._index = {}
        self._reader = None

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, tensors={len(self._index)})"


def gguf_config(reader, path: Path) -> dict:
    """The HF config.json fields of a llama-architecture GGUF, from its metadata; every number checked
    (no zero head count, heads that divide, a bounded context) before anything is built from it."""
    arch = read_field(reader, "general.architecture")

    def need(key: str):
        value = read_field(reader, f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata has no {arch}.{key}")
        return value

    def count(key: str, value=None, **bounds) -> int:
        return metadata_int(path, f"{arch}.{key}", need(key) if value is None else value, **bounds)

    hidden, heads = count("embedding_length"), count("attention.head_count")
    kv_heads = count("attention.head_count_kv", read_field(reader, f"{arch}.attention.head_count_kv", heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:  # its length, without decoding the vocabulary
        tokens = len(tokens) if isinstance(tokens, ArrayField) else len(tokens.data)
    vocab = read_field(reader, f"{arch}.vocab_size") or tokens
    if vocab is None:
        raise CheckpointError(
            f"{path}: GGUF metadata gives no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)"
        )
    vocab = count("vocab_size", vocab)
    key_length = read_field(reader, f"{arch}.attention.key_length")
    key_length = None if key_length is None else count("attention.key_length", key_length)
    head_dim = head_dim_of(path, arch, hidden, heads, kv_heads, key_length)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": count("feed_forward_length"),
        "num_hidden_layers": count("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(read_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": count(
            "context_length", read_field(reader, f"{arch}.context_length", 2048), maximum=MAX_POSITIONS
        ),
        "vocab_size": vocab,
        "torch_dtype": "float32",
    }
    scaling = read_field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise CheckpointError(f"{path}: GGUF rope scaling {scaling!r} is not supported (only linear)")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    for key in ("bos_token_id", "eos_token_id"):
        value = read_field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = metadata_int(path, f"tokenizer.ggml.{key}", value, minimum=0, maximum=vocab - 1)
    return config

"""Read HF checkpoints so that each rank reads only the slices it owns.

A rank of a tensor-parallel group needs a quarter of `q_proj.weight`, not the whole
checkpoint: loading everything and then cutting would make every rank's peak memory the
full model. `Checkpoint` maps tensor names to safetensors files and hands out `LazyTensor`s,
whose indexing goes through `safe_open(...).get_slice(...)`, which mmaps the file and copies
only the requested region. Sharded layers take their piece with `narrow`, which works the
same on a `LazyTensor` and on an in-memory `torch.Tensor` (a model built in the process).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any, Iterator, Union

import torch

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors' dtype strings -> torch dtypes (only the ones this torch build knows).
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U8": "uint8",
        "U16": "uint16",
        "U32": "uint32",
        "U64": "uint64",
        "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E5M2": "float8_e5m2",
        "C64": "complex64",
    }.items()
    if hasattr(torch, attr)
}


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, malformed or lacks a tensor someone asked for."""


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{what} {path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from exc


def _safe_open(file: Path):
    """Open one safetensors file, turning the library's error into one that names the file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as exc:
        raise CheckpointError(f"corrupt or truncated safetensors file {file}: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot open safetensors file {file}: {exc.strerror or exc}") from exc


class LazyTensor:
    """A checkpoint tensor that is not read until indexed: `t[a:b, c:d]` reads just that region."""

    def __init__(self, checkpoint: "Checkpoint", name: str, file: Path, shape: tuple[int, ...], dtype: torch.dtype):
        self._checkpoint = checkpoint
        self.name = name
        self.file = file
        self.shape = shape
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of 0-d tensor {self.name}")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={self.shape}, dtype={self.dtype}, file={self.file.name})"

    def _normalize(self, index) -> tuple:
        """Validate an int/slice/tuple index against the shape so errors name this tensor."""
        if not isinstance(index, tuple):
            index = (index,)
        if any(i is Ellipsis for i in index):
            if sum(i is Ellipsis for i in index) > 1:
                raise IndexError(f"{self.name}: an index can only have a single ellipsis")
            at = next(k for k, i in enumerate(index) if i is Ellipsis)
            fill = len(self.shape) - (len(index) - 1)
            index = index[:at] + (slice(None),) * max(fill, 0) + index[at + 1 :]
        if len(index) > len(self.shape):
            raise IndexError(f"{self.name}: too many indices ({len(index)}) for a tensor of shape {self.shape}")
        out: list = []
        for dim, (i, size) in enumerate(zip(index, self.shape)):
            if isinstance(i, bool) or not isinstance(i, (int, slice)):
                try:
                    i = i.__index__()
                except (AttributeError, TypeError):
                    raise TypeError(
                        f"{self.name}: index for dim {dim} must be an int or a slice, got {type(i).__name__}"
                    ) from None
            if isinstance(i, int):
                if not -size <= i < size:
                    raise IndexError(f"{self.name}: index {i} is out of range for dim {dim} of size {size}")
                out.append(i % size)
            else:
                start, stop, step = i.indices(size)
                if step <= 0:
                    raise IndexError(f"{self.name}: slice step must be positive, got {step} for dim {dim}")
                out.append(slice(start, max(start, stop), step))
        return tuple(out) + (slice(None),) * (len(self.shape) - len(out))

    def __getitem__(self, index) -> torch.Tensor:
        if not self.shape:
            if index in ((), Ellipsis, (Ellipsis,)):
                return self.load()
            raise IndexError(f"{self.name}: a 0-d tensor can only be indexed with () or ...")
        index = self._normalize(index)
        return self._checkpoint._handle(self.file).get_slice(self.name)[index]

    def load(self) -> torch.Tensor:
        """The whole tensor (for replicated weights such as norms)."""
        return self._checkpoint._handle(self.file).get_tensor(self.name)


Source = Union[LazyTensor, torch.Tensor]


def source_shape(source: Source) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or an in-memory tensor, without reading data."""
    return tuple(int(d) for d in source.shape)


def narrow(source: Source, dim: int, start: int, length: int) -> torch.Tensor:
    """`source[..., start:start+length, ...]` along `dim`, reading only that region for a LazyTensor.

    The one call a sharded layer's weight_loader makes to take its shard, whether the full
    tensor sits in a checkpoint file or in an in-memory model.
    """
    shape = source_shape(source)
    name = source.name if isinstance(source, LazyTensor) else "tensor"
    if not -len(shape) <= dim < len(shape):
        raise CheckpointError(f"{name}: dim {dim} out of range for shape {shape}")
    dim %= len(shape)
    if start < 0 or length < 0 or start + length > shape[dim]:
        raise CheckpointError(
            f"{name}: cannot take [{start}:{start + length}] of dim {dim}, which has size {shape[dim]} (shape {shape})"
        )
    index = tuple(slice(start, start + length) if d == dim else slice(None) for d in range(len(shape)))
    return source[index]


class TensorIndex:
    """What every checkpoint kind answers alike from `self._index` (tensor name -> where it is):
    the names, membership, and `with` that closes it. A HF directory and a GGUF file both are one."""

    _index: dict

    def names(self) -> list[str]:
        return sorted(self._index)

    def has(self, name: str) -> bool:
        return name in self._index

    __contains__ = has

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Checkpoint(TensorIndex):
    """A HF checkpoint directory: config.json plus one or more safetensors files.

    Opening reads only JSON and the safetensors headers; tensor data stays on disk until a
    `LazyTensor` is indexed. One safetensors handle is kept per file, shared by its tensors.
    """

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        self._handles: dict[Path, Any] = {}
        self._key_cache: dict[Path, set[str]] = {}
        self._closed = False
        if not self.path.exists():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint path {self.path} is not a directory")
        config_file = self.path / CONFIG_FILE
        if not config_file.is_file():
            raise CheckpointError(f"checkpoint {self.path} has no {CONFIG_FILE}")
        config = _read_json(config_file, "checkpoint config")
        if not isinstance(config, dict):
            raise CheckpointError(
                f"checkpoint config {config_file} must hold a JSON object, not {type(config).__name__}"
            )
        self.config: dict = config
        try:
            self._index = self._map_tensors()
        except BaseException:
            self.close()
            raise

    def _map_tensors(self) -> dict[str, Path]:
        """Name -> file, checked against each file's header so a bad index fails here, not mid-load."""
        index_file = self.path / INDEX_FILE
        if index_file.is_file():
            index = _read_json(index_file, "safetensors index")
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"safetensors index {index_file} has no 'weight_map' object")
            files: dict[str, Path] = {}
            for name, shard in weight_map.items():
                if not isinstance(shard, str):
                    raise CheckpointError(f"safetensors index {index_file}: weight_map[{name!r}] is not a file name")
                files[name] = self.path / shard
            for shard in sorted(set(files.values())):
                if not shard.is_file():
                    raise CheckpointError(f"shard {shard.name} named in {index_file} is missing from {self.path}")
            for name, shard in files.items():
                if name not in self._keys(shard):
                    raise CheckpointError(
                        f"safetensors index {index_file} maps tensor {name!r} to {shard.name}, which does not contain it"
                    )
            return files

        single = self.path / SINGLE_FILE
        shards = [single] if single.is_file() else sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"checkpoint {self.path} has no safetensors files ({SINGLE_FILE} or an index)")
        files = {}
        for shard in shards:
            for name in self._keys(shard):
                if name in files:
                    raise CheckpointError(
                        f"checkpoint {self.path}: tensor {name!r} is in both {files[name].name} and {shard.name}"
                    )
                files[name] = shard
        return files

    def _keys(self, file: Path) -> set[str]:
        if file not in self._key_cache:
            self._key_cache[file] = set(self._handle(file).keys())
        return self._key_cache[file]

    def _handle(self, file: Path):
        if self._closed:
            raise CheckpointError(f"checkpoint {self.path} is closed")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = _safe_open(file)
        return handle

    def tensor(self, name: str) -> LazyTensor:
        file = self._index.get(name)
        if file is None:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {self.path}")
        view = self._handle(file).get_slice(name)
        dtype_name = view.get_dtype()
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} in {file} has unsupported dtype {dtype_name}")
        return LazyTensor(self, name, file, tuple(int(d) for d in view.get_shape()), dtype)

    @property
    def files(self) -> list[Path]:
        return sorted(set(self._index.values()))

    def close(self) -> None:
        """Drop the mmaps; LazyTensors from this checkpoint stop working."""
        handles, self._handles = self._handles, {}
        self._closed = True
        for handle in handles.values():
            try:
                handle.__exit__(None, None, None)
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, tensors={len(self._index)}, files={len(self.files)})"


def open_checkpoint(path: Union[str, os.PathLike]) -> Checkpoint:
    """Open a HF checkpoint directory; raises CheckpointError naming what is wrong and where."""
    return Checkpoint(path)


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def return_freed_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the OS (glibc's malloc_trim).

    Loading reads, dequantizes and copies through many temporaries; freed, they stay in the
    process's resident memory until trimmed (a sizeable share of a small model's), and the KV
    cache sizing and the memory figures would count them. A no-op beyond the collection where the C
    library has no malloc_trim."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def current_rss_mb() -> float:
    """Resident memory right now in MiB, from /proc/self/statm; the peak where /proc is absent."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return peak_rss_mb()
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)

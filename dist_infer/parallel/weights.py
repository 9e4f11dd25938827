"""Taking a shard out of a full weight, whether it is in memory or still on disk.

A weight *source* is anything with `.shape` and numpy-style slicing: a torch.Tensor, or a
checkpoint's lazy tensor that reads only the requested bytes. Layers narrow sources; they never
ask for the whole tensor, so a rank reads only what it owns.
"""

from __future__ import annotations

import torch


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not match the model config."""


def shape_of(source) -> tuple[int, ...]:
    return tuple(int(d) for d in source.shape)


def narrow(source, dim: int, start: int, length: int) -> torch.Tensor:
    index = [slice(None)] * len(shape_of(source))
    index[dim] = slice(start, start + length)
    return source[tuple(index)]


def check_shape(name: str, source, expected: tuple[int, ...]) -> None:
    got = shape_of(source)
    if got != tuple(expected):
        tensor = getattr(source, "name", None)  # a checkpoint's LazyTensor knows its file's tensor name
        where = f"{name} (checkpoint tensor {tensor!r})" if isinstance(tensor, str) and tensor != name else name
        raise WeightShapeError(f"{where}: checkpoint tensor has shape {list(got)}, the config needs {list(expected)}")


def copy_into(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise WeightShapeError(f"{name}: shard has shape {list(value.shape)}, the layer expects {list(param.shape)}")
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def load_replicated(param: torch.Tensor, source, name: str) -> None:
    """Load a tensor every rank holds whole (norm weights, a router gate)."""
    check_shape(name, source, tuple(param.shape))
    copy_into(param, source[tuple(slice(None) for _ in param.shape)], name)

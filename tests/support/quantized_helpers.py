"""What the unit tests of weight-only quantization share: the native kernels (None without a C
compiler) and the mark that skips without them, seeded weights and inputs, a relative closeness
check, a tp group of threads, a layer loaded (quantized or not) in one call, and prompts whose ids
fall in both halves of the tiny vocabulary (so both tp=2 vocabulary shards are read)."""

from __future__ import annotations

import pytest
import torch

from dist_infer.kernels import load_cpu_kernels
from tests.support.threads import thread_groups

NATIVE = load_cpu_kernels()
needs_native = pytest.mark.skipif(NATIVE is None, reason="no C compiler: the native CPU kernels are not built")
VOCAB_PROMPTS = [[5, 9, 17, 3, 44], [7, 11] * 6, [120, 64, 63, 127]]  # ids of both halves of the vocabulary


def rand_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A seeded [rows, cols] weight of a linear layer's scale."""
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1


def rand_input(rows: int, cols: int) -> torch.Tensor:
    """The same seeded [rows, cols] input whenever asked (a test compares two products of it)."""
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(99))


def assert_close_relative(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    """The largest difference within `rtol` of the largest value wanted."""
    scale = want.abs().max().clamp_min(1e-6)
    assert (got - want).abs().max() / scale < rtol, float((got - want).abs().max() / scale)


def tp_group(size: int, rank: int):
    """Rank `rank`'s tp communicator of a tp group of `size` threads."""
    return thread_groups(size, 1)[rank].tp


def load_layer(layer, loads, scheme=None, kernels=None):
    """`layer` with `kernels`, set to `scheme` (None: floats), loaded by weight_loader(*args) for each of `loads`."""
    layer.kernels = kernels
    if scheme:
        layer.set_quantization(scheme)
    for args in loads:
        layer.weight_loader(*args)
    return layer


def assert_quantized_params_gone(layer) -> None:
    """A quantized layer holds no float weight parameter (a bias at most)."""
    assert layer.weight is None and layer.quantized is not None
    assert [n for n, _ in layer.named_parameters()] in ([], ["bias"])

"""The tp linear layers loaded quantized (int8, int4, with or without the native kernels) against
plain layers holding the dequantized weights: column, merged and QKV layers per rank, a row layer
quantizing its own column shard; and `auto`, which keeps a source's blocks (reading only the
shard), falls back to exact floats where a shard cuts a group, and keeps group-wise int8 only
with the native kernels."""

from __future__ import annotations

import pytest
import torch

from dist_infer.parallel.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from dist_infer.parallel.quantized import QuantizedWeight, quantize_int4, quantize_int8
from dist_infer.parallel.quantized_linear import GroupQuantLinear, Int4Linear, Int8Linear, quantize_as
from tests.support.quantized_helpers import (
    NATIVE,
    assert_close_relative,
    assert_quantized_params_gone,
    load_layer,
    needs_native,
    rand_input,
    rand_weight,
    tp_group,
)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rank", [0, 1])
def test_column_merged_qkv_layers_equal_dequantized_plain_layers(scheme, rank, native):
    tp = tp_group(2, rank)
    H, x = 64, rand_input(3, 64)
    weights = {
        name: rand_weight(n, H, seed=s)
        for s, (name, n) in enumerate({"up": 96, "gate": 96, "q": 64, "k": 32, "v": 32}.items())
    }
    deq = {name: quantize_as(t, scheme).dequantize() for name, t in weights.items()}
    builds = [
        (lambda: ColumnParallelLinear(H, 96, tp, bias=True), lambda w: [(w["up"],), (torch.ones(96), "bias")]),
        (lambda: MergedColumnParallelLinear(H, [96, 96], tp), lambda w: [(w["gate"], 0), (w["up"], 1)]),
        (lambda: QKVParallelLinear(H, 16, 4, 2, tp), lambda w: [(w["q"], "q"), (w["k"], "k"), (w["v"], "v")]),
    ]
    for make, loads in builds:
        quant = load_layer(make(), loads(weights), scheme, NATIVE if native else None)
        plain = load_layer(make(), loads(deq))
        assert_quantized_params_gone(quant)
        assert isinstance(quant.quantized, GroupQuantLinear if native else (Int8Linear, Int4Linear))
        got, want = quant(x), plain(x)
        for g, w in zip(
            got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want], strict=True
        ):
            assert_close_relative(g, w, rtol=1e-4)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_row_parallel_quantizes_its_own_column_shard(scheme, native):
    w, x = rand_weight(48, 128), rand_input(2, 128)
    for rank in (0, 1):
        layer = load_layer(RowParallelLinear(128, 48, tp_group(2, rank)), [(w,)], scheme, NATIVE if native else None)
        assert_quantized_params_gone(layer)
        shard = w[:, 64 * rank : 64 * (rank + 1)]
        assert_close_relative(
            layer.partial(x[:, 64 * rank : 64 * (rank + 1)]),
            x[:, 64 * rank : 64 * (rank + 1)] @ quantize_as(shard, scheme).dequantize().T,
            rtol=1e-4,
        )


class FakeQuantizedSource:
    """A float weight that also hands out its exact quantized blocks (what a GGUF tensor does),
    refusing slices that cut a group, and logging what it was asked for."""

    def __init__(self, qw: QuantizedWeight):
        self.qw, self.shape, self.asked = qw, qw.shape, []

    def quantized_slice(self, rows: slice, cols: slice) -> QuantizedWeight:
        self.asked.append(("quantized", rows, cols))
        r0, r1, _ = rows.indices(self.shape[0])
        c0, c1, _ = cols.indices(self.shape[1])
        return self.qw.narrow(0, r0, r1 - r0).narrow(1, c0, c1 - c0)

    def __getitem__(self, index):
        self.asked.append(("float",) + tuple(index))
        return self.qw.dequantize()[index]


def test_auto_keeps_a_sources_blocks_and_reads_only_the_shard():
    qw = QuantizedWeight(
        torch.randint(0, 16, (64, 64), dtype=torch.int8), torch.rand(64, 2) * 0.01, torch.rand(64, 2) * -0.05, 32, 4
    )  # Q4_1-like
    src = FakeQuantizedSource(qw)
    layer = load_layer(ColumnParallelLinear(64, 64, tp_group(2, 1)), [(src,)], "auto")
    assert isinstance(layer.quantized, Int4Linear)
    assert src.asked == [("quantized", slice(32, 64), slice(None))]
    assert_close_relative(layer(rand_input(2, 64)), rand_input(2, 64) @ qw.dequantize()[32:].T, rtol=1e-4)


def test_auto_row_shard_cutting_a_group_falls_back_to_floats():
    """in 96 over tp=2: rank 1's columns start at 48, inside a group of 32: read as exact floats."""
    qw = quantize_int4(rand_weight(32, 96), 32)
    layer = load_layer(RowParallelLinear(96, 32, tp_group(2, 1)), [(FakeQuantizedSource(qw),)], "auto")
    assert layer.quantized is None and layer.weight is not None
    torch.testing.assert_close(layer.weight.data, qw.dequantize()[:, 48:])


@needs_native
def test_auto_keeps_group_wise_int8_with_native_kernels():
    qw = quantize_int8(rand_weight(32, 64), 32)  # GGUF Q8_0's layout
    layer = load_layer(ColumnParallelLinear(64, 32, tp_group(1, 0)), [(FakeQuantizedSource(qw),)], "auto", NATIVE)
    assert isinstance(layer.quantized, GroupQuantLinear) and layer.weight is None
    assert_close_relative(layer(rand_input(2, 64)), rand_input(2, 64) @ qw.dequantize().T)


def test_auto_group_wise_int8_is_exact_as_floats_and_int8_requantizes_per_channel():
    """Without the native kernels: group-wise int8 has no torch kernel (floats, exact); int8
    requantizes it per output channel for torch's."""
    qw = quantize_int8(rand_weight(32, 64), 32)  # GGUF Q8_0's layout
    auto = load_layer(ColumnParallelLinear(64, 32, tp_group(1, 0)), [(FakeQuantizedSource(qw),)], "auto")
    torch.testing.assert_close(auto.weight.data, qw.dequantize())
    int8 = load_layer(ColumnParallelLinear(64, 32, tp_group(1, 0)), [(FakeQuantizedSource(qw),)], "int8")
    assert isinstance(int8.quantized, Int8Linear)
    assert_close_relative(int8(rand_input(2, 64)), rand_input(2, 64) @ quantize_int8(qw.dequantize()).dequantize().T)

"""Weight-only quantization's pure functions: int8 / int4 round trips within half a step (int4's
group extremes exact), constant and zero rows exact, narrowing by rows and whole groups of columns,
signed 4-bit blocks stacking with unsigned ones."""

from __future__ import annotations

import pytest
import torch

from dist_infer.parallel.quantized import QuantizedWeight, quantize_int4, quantize_int8, stack_rows
from tests.support.quantized_helpers import rand_weight


@pytest.mark.parametrize("group", [None, 32])
def test_int8_round_trip_within_half_a_step(group):
    w = rand_weight(24, 80)
    qw = quantize_int8(w, group)
    assert qw.bits == 8 and qw.zeros is None and qw.q.dtype == torch.int8
    assert int(qw.q.abs().max()) <= 127
    step = qw.scales.repeat_interleave(qw.group_size, dim=1)[:, :80]
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert qw.scales.shape == ((24, 1) if group is None else (24, 3))  # a last partial group of 16


@pytest.mark.parametrize("group", [32, 64])
def test_int4_round_trip_within_half_a_step_extremes_exact(group):
    w = rand_weight(16, 128, seed=1)
    qw = quantize_int4(w, group)
    assert qw.bits == 4 and 0 <= int(qw.q.min()) and int(qw.q.max()) <= 15
    deq = qw.dequantize()
    step = qw.scales.repeat_interleave(group, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    g = w.reshape(16, -1, group)
    torch.testing.assert_close(deq.reshape(16, -1, group).amin(2), g.amin(2), rtol=0, atol=1e-6)
    torch.testing.assert_close(deq.reshape(16, -1, group).amax(2), g.amax(2), rtol=0, atol=1e-6)


def test_constant_and_zero_rows_are_exact():
    w = torch.zeros(2, 64)
    w[1] = 0.25
    for qw in (quantize_int8(w), quantize_int4(w)):
        torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=0)


def test_narrow_rows_and_whole_groups_of_columns():
    qw = quantize_int4(rand_weight(8, 128), 32)
    torch.testing.assert_close(qw.narrow(0, 2, 3).dequantize(), qw.dequantize()[2:5])
    torch.testing.assert_close(qw.narrow(1, 32, 64).dequantize(), qw.dequantize()[:, 32:96])
    with pytest.raises(ValueError, match="cut a group"):
        qw.narrow(1, 16, 32)


def test_signed_4bit_and_stacking():
    """A source's signed -8..7 blocks (zeros None) stack with unsigned ones; values unchanged."""
    signed = QuantizedWeight(torch.randint(-8, 8, (4, 64), dtype=torch.int8), torch.rand(4, 2), None, 32, 4)
    unsigned = quantize_int4(rand_weight(4, 64))
    stacked = stack_rows([signed, unsigned])
    assert int(stacked.q.min()) >= 0
    torch.testing.assert_close(stacked.dequantize(), torch.cat([signed.dequantize(), unsigned.dequantize()]))
    assert stack_rows([quantize_int4(rand_weight(4, 64), 32), quantize_int4(rand_weight(4, 64), 64)]) is None

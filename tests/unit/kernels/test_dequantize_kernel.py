"""The native `dequantize_rows` against QuantizedWeight.dequantize, bit for bit.

The weight is read from the buffers GroupQuantLinear holds (int8, or its packed 4-bit layout, with
unsigned values and explicit zeros), so what is checked is what the layer's prefill path gets.
Scales and zeros are random floats (not quantize_* results), so most products round: a fused
multiply-add would round once where the reference rounds twice, and the bit-exact check sees it.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from dist_infer.kernels import load_cpu_kernels
from dist_infer.parallel.quantized import QuantizedWeight
from dist_infer.parallel.quantized_linear import GroupQuantLinear

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the native kernels are not built")


def _weight(rows: int, cols: int, group: int, bits: int, zeros: bool, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    # 4-bit: 0..15 with zeros (quantize_int4's), or a signed source's -8..7 without
    low, high = (-128, 128) if bits == 8 else (0, 16) if zeros else (-8, 8)
    q = torch.randint(low, high, (rows, cols), generator=gen, dtype=torch.int8)
    scales = torch.rand(rows, cols // group, generator=gen) * 0.02 + 1e-4
    z = torch.randn(rows, cols // group, generator=gen) * 0.1 if zeros else None
    return QuantizedWeight(q, scales, z, group, bits)


def _dequantize(layer: GroupQuantLinear, start: int, stop: int) -> Optional[torch.Tensor]:
    out = torch.full((stop - start, layer.in_features), float("nan"))
    zeros = None if layer.zeros is None else layer.zeros[start:stop]
    ok = kernels.dequantize_rows(
        layer.q[start:stop], layer.scales[start:stop], zeros, out, layer.group_size, layer.bits
    )
    return out if ok else None


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    differ = got.view(torch.int32) != want.view(torch.int32)
    assert not differ.any(), f"{int(differ.sum())} values differ, first at {differ.nonzero()[0].tolist()}"


CASES = [  # (bits, cols, group, zeros)
    (8, 576, 576, False),  # per output channel, the int8 scheme's layout
    (8, 100, 100, False),  # per channel, K off the vector width
    (8, 576, 32, False),
    (8, 576, 32, True),
    (8, 144, 48, True),  # groups off the vector width (GGUF-like odd sizes)
    (4, 576, 32, True),
    (4, 576, 64, True),
    (4, 576, 32, False),  # a signed source: the layer's unsigned_int4 shifts it and supplies zeros
    (4, 120, 40, True),  # half a group (20) off the vector width
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits,cols,group,zeros", CASES)
def test_matches_the_reference_bit_for_bit(bits, cols, group, zeros, threads):
    rows = 300
    qw = _weight(rows, cols, group, bits, zeros, seed=bits * 1000 + cols + group)
    layer = GroupQuantLinear(qw)
    want = (qw.unsigned_int4() if bits == 4 else qw).dequantize()  # the weight as the layer holds it
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for start, stop in [(0, rows), (0, 1), (0, 7), (5, 38), (37, 300), (299, 300)]:  # row blocks at offsets
            got = _dequantize(layer, start, stop)
            assert got is not None, "the kernel should take the layer's own buffers"
            _same_bits(got, want[start:stop])
            _same_bits(got, layer.dequantized_rows(start, stop))  # the torch path it stands in for
    finally:
        torch.set_num_threads(before)


def test_the_check_would_see_a_fused_multiply_add():
    """On this data a single rounding of q * scale + zero (float64, then fp32) differs from the
    reference's two somewhere: the bit-exact test above is not passing by luck."""
    qw = _weight(64, 576, 32, 8, True)
    s = qw.scales.repeat_interleave(32, dim=1).double()
    z = qw.zeros.repeat_interleave(32, dim=1).double()
    fused = (qw.q.double() * s + z).float()
    assert (fused != qw.dequantize()).any()


def test_zero_rows_and_a_large_block():
    qw = _weight(4096, 576, 32, 4, True, seed=7)
    layer = GroupQuantLinear(qw)
    assert _dequantize(layer, 10, 10).shape == (0, 576)
    _same_bits(_dequantize(layer, 0, 4096), qw.unsigned_int4().dequantize())


def _refused(q, scales, zeros, out, group, bits) -> None:
    sentinel = out.clone()
    assert kernels.dequantize_rows(q, scales, zeros, out, group, bits) is False
    assert torch.equal(out.view(torch.int32), sentinel.view(torch.int32)) if out.dtype == torch.float32 else True


def test_refuses_what_it_does_not_take():
    q8, q4 = torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 32, dtype=torch.uint8)
    s, z, out = torch.ones(4, 2), torch.zeros(4, 2), torch.zeros(4, 64)
    assert kernels.dequantize_rows(q8, s, z, out.clone(), 32, 8) and kernels.dequantize_rows(
        q4, s, z, out.clone(), 32, 4
    )
    _refused(q8, s, z, out, 32, 3)  # bits
    _refused(q8, s, z, out, 32, 4)  # int8 bytes as packed 4-bit (and too many columns)
    _refused(q4, s, z, out, 32, 8)  # packed bytes as int8
    _refused(q8.to(torch.int32), s, z, out, 32, 8)
    _refused(q8, s.double(), z, out, 32, 8)
    _refused(q8, s, z.double(), out, 32, 8)
    _refused(q8, s, z, out.double(), 32, 8)
    _refused(q8, s, z, out.bfloat16(), 32, 8)
    _refused(q8, s, z, torch.zeros(64, 4).t(), 32, 8)  # not contiguous
    _refused(q8.t().contiguous().t(), s, z, out, 32, 8)
    _refused(q8, torch.ones(2, 4).t(), z, out, 32, 8)
    _refused(q8, s, z, torch.zeros(5, 64), 32, 8)  # more rows than q holds
    _refused(q8[:3], s, z, out, 32, 8)
    _refused(q8, s[:3], z, out, 32, 8)
    _refused(q8, s, z[:, :1], out, 32, 8)
    _refused(q8, s, z, out, 24, 8)  # groups that do not tile the columns
    _refused(q8, torch.ones(4, 1), None, out, 0, 8)
    _refused(q8, s, z, out, 64, 8)  # scales for groups of 32, said to be of 64
    _refused(torch.zeros(4, 33, dtype=torch.uint8), torch.ones(4, 6), None, torch.zeros(4, 66), 11, 4)  # odd group
    _refused(q8, s, z, out.view(-1), 32, 8)
    _refused(q8.to("meta"), s, z, out, 32, 8)


def test_many_rows_multiply_dequantized_blocks_through_the_kernels_gemm(monkeypatch):
    """Past the native quant_linear's rows: blocks of W dequantized in C, multiplied by the kernels'
    GEMM (oneDNN's where it loads), equal to the torch path's F.linear on the dequantized weight."""
    qw = _weight(300, 96, 32, 4, True, seed=3)
    layer = GroupQuantLinear(qw)
    x = torch.randn(70, 96)
    calls = []
    if kernels.gemm is not None:
        real = kernels.gemm

        class Spy:
            def linear(self, a, w):
                calls.append(tuple(w.shape))
                return real.linear(a, w)

        monkeypatch.setattr(kernels, "gemm", Spy())
    want = torch.nn.functional.linear(x, qw.unsigned_int4().dequantize())
    torch.testing.assert_close(layer(x, kernels), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(layer(x, None), want, atol=1e-4, rtol=1e-5)
    assert len(calls) == (1 if kernels.gemm is not None else 0)  # one block (rows up to DEQUANTIZE_ROWS)

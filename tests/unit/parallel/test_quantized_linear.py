"""The quantized linear modules: each kernel path (int8, int4, GGUF-style blocks, bf16, the native
group-wise kernel and its torch path) against `x @ qw.dequantize().T`, the float fallback where no
kernel fits, and lookups: the table's rows bit for bit in every form a tied embedding reads, and
the tied forms sharing what can be looked up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_infer.parallel.quantized import QuantizedWeight, quantize_int4, quantize_int8
from dist_infer.parallel.quantized_linear import (
    FloatLinear,
    GroupQuantLinear,
    Int4Linear,
    Int8Linear,
    pack_block,
    pack_lookup,
    pack_tied,
)
from tests.support.quantized_helpers import NATIVE, assert_close_relative, needs_native, rand_input, rand_weight


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_kernel_equals_dequantized_product(rows):
    qw = quantize_int8(rand_weight(40, 96))
    m = pack_block(qw, torch.float32, "t")
    assert isinstance(m, Int8Linear)
    assert_close_relative(m(rand_input(rows, 96)), rand_input(rows, 96) @ qw.dequantize().T)


@pytest.mark.parametrize("out,group", [(48, 32), (40, 64), (16, 128)])  # 40: rows padded to 48
def test_int4_kernel_equals_dequantized_product(out, group):
    qw = quantize_int4(rand_weight(out, 256), group)
    m = pack_block(qw, torch.float32, "t")
    assert isinstance(m, Int4Linear)
    for rows in (1, 3):
        assert_close_relative(m(rand_input(rows, 256)), rand_input(rows, 256) @ qw.dequantize().T, rtol=1e-4)


def test_int4_kernel_takes_gguf_style_blocks():
    """Q4_0 (q 0..15, zeros -8d) and a signed source: both exact through the (q - 8) * s + z kernel."""
    d = torch.rand(32, 4) * 0.01
    q4_0 = QuantizedWeight(torch.randint(0, 16, (32, 128), dtype=torch.int8), d, -8 * d, 32, 4)
    signed = QuantizedWeight(torch.randint(-8, 8, (32, 128), dtype=torch.int8), d, None, 32, 4)
    for qw in (q4_0, signed):
        assert_close_relative(
            pack_block(qw, torch.float32, "t")(rand_input(2, 128)), rand_input(2, 128) @ qw.dequantize().T, rtol=1e-4
        )


def test_bfloat16_kernels():
    x = rand_input(2, 128).bfloat16()
    for qw in (quantize_int8(rand_weight(32, 128)), quantize_int4(rand_weight(32, 128))):
        got = pack_block(qw, torch.bfloat16, "t")(x)
        assert got.dtype == torch.bfloat16
        assert_close_relative(got.float(), x.float() @ qw.dequantize().T, rtol=2e-2)


def _gguf_like() -> dict[str, QuantizedWeight]:
    d = torch.rand(200, 6, generator=torch.Generator().manual_seed(3)) * 0.01
    return {
        "int8 per channel": quantize_int8(rand_weight(200, 192)),
        "int8 g32 (Q8_0)": quantize_int8(rand_weight(200, 192), 32),
        "int4 g32": quantize_int4(rand_weight(200, 192)),
        "int4 g64": quantize_int4(rand_weight(200, 192), 64),
        "Q4_0": QuantizedWeight(torch.randint(0, 16, (200, 192), dtype=torch.int8), d, -8 * d, 32, 4),
        "signed 4-bit": QuantizedWeight(torch.randint(-8, 8, (200, 192), dtype=torch.int8), d, None, 32, 4),
    }


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 20, 70])  # one native call, tiles of 8, dequantized blocks
def test_group_quant_linear_equals_dequantized_product(native, rows):
    """The native quant_linear (any group of a multiple of 32, zeros or not, 4-bit packed) and its
    torch path (blocks of rows dequantized)."""
    x = rand_input(rows, 192)
    for name, qw in _gguf_like().items():
        m = pack_block(qw, torch.float32, name, native=True)
        assert isinstance(m, GroupQuantLinear), name
        assert_close_relative(m(x, NATIVE if native else None), x @ qw.dequantize().T)


@needs_native
@pytest.mark.parametrize("rows", [4, 6, 7, 8])
def test_int4_rows_of_w_in_pairs_with_an_odd_one_left(rows):
    """4 to 8 rows of x take two rows of W a pass; an odd count of W's rows (per thread too) ends
    with one through the plain kernel: the same product either way."""
    d = torch.rand(201, 6, generator=torch.Generator().manual_seed(5)) * 0.01
    for qw in (
        quantize_int4(rand_weight(201, 192)),
        QuantizedWeight(torch.randint(0, 16, (201, 192), dtype=torch.int8), d, -8 * d, 32, 4),
    ):
        x = rand_input(rows, 192)
        m = pack_block(qw, torch.float32, "odd", native=True)
        assert_close_relative(m(x, NATIVE), x @ qw.dequantize().T)


def test_no_kernel_falls_back_to_the_dequantized_weight():
    """Group-wise int8 (GGUF Q8_0), 4-bit groups of 16, columns not in whole groups: float, exact."""
    cases = [
        quantize_int8(rand_weight(16, 64), 32),
        quantize_int4(rand_weight(16, 64), 16),
        quantize_int4(rand_weight(16, 80), 32),
    ]
    for qw in cases:
        m = pack_block(qw, torch.float32, "t")
        assert isinstance(m, FloatLinear)
        torch.testing.assert_close(m.weight, qw.dequantize())


# -- lookups ----------------------------------------------------------------------------------------


def _tables() -> dict[str, QuantizedWeight]:
    d = torch.rand(100, 2, generator=torch.Generator().manual_seed(3)) * 0.01
    return {
        "int8 per row": quantize_int8(rand_weight(100, 64)),
        "int8 g32 (Q8_0)": quantize_int8(rand_weight(100, 64), 32),
        "int4 g32": quantize_int4(rand_weight(100, 64)),
        "Q4_0": QuantizedWeight(torch.randint(0, 16, (100, 64), dtype=torch.int8), d, -8 * d, 32, 4),
    }


@pytest.mark.parametrize("name", list(_tables()))
def test_lookup_is_exactly_the_dequantized_rows(name):
    """GroupQuantLinear (the lookup table, and the native head's form) and Int8Linear (torch's
    int8 head, which a tied embedding reads too) give the dequantized table's rows bit for bit."""
    qw = _tables()[name]
    ids = torch.tensor([[0, 99, 5], [5, 42, 17]])
    want = F.embedding(ids, qw.dequantize())
    forms = [pack_lookup(qw, torch.float32, name), pack_block(qw, torch.float32, name, native=True)]
    forms += [m for m in [pack_block(qw, torch.float32, name)] if isinstance(m, Int8Linear)]
    for m in forms:
        assert isinstance(m, (GroupQuantLinear, Int8Linear)), type(m)
        assert torch.equal(m.lookup(ids), want), type(m)


def test_tied_forms_share_what_can_be_looked_up():
    int8, int4 = quantize_int8(rand_weight(100, 64)), quantize_int4(rand_weight(100, 64))
    table, head = pack_tied(int8, torch.float32, "t")
    assert table is head and isinstance(head, Int8Linear)
    table, head = pack_tied(int4, torch.float32, "t", native=True)
    assert table is head and isinstance(head, GroupQuantLinear)
    table, head = pack_tied(int4, torch.float32, "t")  # torch's int4 packing cannot be indexed
    assert isinstance(head, Int4Linear) and isinstance(table, GroupQuantLinear)

"""The paged decode attention kernel (kernels/gpu/paged_decode.py) in Triton's interpreter, against a
plain fp64 reference: GQA groups, sliding windows, block tables in any order, contexts that end
mid-block and mid-partition, and results that do not depend on the block table's width (the CUDA
graph's wide tables against an eager step's narrow ones, bit for bit)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the dev extra installs it)")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="CPU tensors need Triton's interpreter (tests/conftest.py sets it where no GPU is seen)",
)

from dist_infer.kernels.gpu.paged_decode import (  # noqa: E402
    PARTITION,
    paged_decode_attention,
    paged_decode_attention_reference,
)


def _case(dtype, B=3, heads=8, kv_heads=2, dim=64, bs=16, blocks=48, width=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(B, heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: B * width].view(B, width)
    return q, k, v, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 50])
def test_matches_the_reference(dtype, window):
    q, k, v, tables = _case(dtype)
    lens = torch.tensor([1, PARTITION + 7, 12 * 16])  # one key; past a partition's end; every slot of the table
    out = paged_decode_attention(q, k, v, tables, lens, 64**-0.5, window)
    ref = paged_decode_attention_reference(q, k, v, tables, lens, 64**-0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_mqa_and_odd_head_dim():
    """One KV head for every query head, and a head size that is no power of two (padded lanes)."""
    q, k, v, tables = _case(torch.float32, heads=6, kv_heads=1, dim=40)
    lens = torch.tensor([33, 5, 100])
    out = paged_decode_attention(q, k, v, tables, lens, 0.2)
    torch.testing.assert_close(
        out.double(), paged_decode_attention_reference(q, k, v, tables, lens, 0.2), atol=1e-5, rtol=1e-5
    )


def test_a_wider_block_table_changes_no_bit():
    """The graph's table is as wide as the model's longest context; an eager step's is the batch's."""
    q, k, v, tables = _case(torch.float32, width=6)
    wide = torch.cat([tables, torch.randint(0, 48, (3, 20))], dim=1)
    for window in (None, 40):
        lens = torch.tensor([96, 70, 3])
        narrow_out = paged_decode_attention(q, k, v, tables, lens, 0.125, window)
        assert torch.equal(narrow_out, paged_decode_attention(q, k, v, wide, lens, 0.125, window))


def test_strided_lengths_and_tables_as_the_graph_buffers_hold_them():
    """Lengths and tables as views into one buffer (engine/device_io.py DecodeInputs)."""
    q, k, v, tables = _case(torch.float32)
    buffer = torch.zeros(3 + 3 * 12 + 5, dtype=torch.long)
    lens = buffer[:3]
    lens.copy_(torch.tensor([17, 3, 64]))
    view = buffer[3 : 3 + 36].view(3, 12)
    view.copy_(tables)
    torch.testing.assert_close(
        paged_decode_attention(q, k, v, view, lens, 0.125),
        paged_decode_attention(q, k, v, tables.clone(), lens.clone(), 0.125),
        atol=0,
        rtol=0,
    )

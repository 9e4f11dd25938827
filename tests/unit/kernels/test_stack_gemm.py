"""The decode stack's GEMM (kernels/gemm.py): which one is chosen, and that each computes x W^T
under its own calling convention (oneDNN's by value and row-major, BLAS's by reference and
column-major). decode_stack.c calls them the same way: test_fused_decode.py runs the stack's long
steps through each against the layer path and transformers."""

from __future__ import annotations

import pytest
import torch

from dist_infer.kernels.gemm import blas_sgemm, onednn_sgemm, stack_gemm


@pytest.mark.parametrize("choice", ["onednn", "blas"])
def test_each_gemm_computes_the_product_the_stack_asks_for(choice):
    gemm = {"onednn": onednn_sgemm, "blas": blas_sgemm}[choice]()
    if gemm is None:
        pytest.skip(f"no {choice} GEMM loads here")
    assert gemm.row_major == (choice == "onednn") and gemm.name == choice
    torch.manual_seed(0)
    x, w = torch.randn(37, 70), torch.randn(45, 70)  # no dimension a multiple of a vector
    torch.testing.assert_close(gemm.linear(x, w), x @ w.T, atol=1e-4, rtol=1e-5)


def test_the_choice_follows_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv("DIST_INFER_STACK_GEMM", "blas")
    assert stack_gemm() == blas_sgemm()
    monkeypatch.setenv("DIST_INFER_STACK_GEMM", "mkl")
    with pytest.raises(ValueError, match="DIST_INFER_STACK_GEMM='mkl'.*onednn, blas"):
        stack_gemm()
    monkeypatch.delenv("DIST_INFER_STACK_GEMM")
    assert stack_gemm() == (onednn_sgemm() or blas_sgemm())  # unset: oneDNN's where it loads


def test_a_product_it_cannot_take_is_named_and_an_empty_one_is_zeros():
    gemm = stack_gemm()
    if gemm is None:
        pytest.skip("no GEMM loads here")
    with pytest.raises(ValueError, match=r"x \[4, 8\] and w \[3, 7\]"):
        gemm.linear(torch.randn(4, 8), torch.randn(3, 7))  # K differs: it would read past w
    with pytest.raises(ValueError, match="contiguous fp32"):
        gemm.linear(torch.randn(8, 4).T, torch.randn(3, 8))
    assert torch.equal(gemm.linear(torch.randn(5, 0), torch.randn(3, 0)), torch.zeros(5, 3))
    assert gemm.linear(torch.randn(0, 8), torch.randn(3, 8)).shape == (0, 3)

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


def test_the_bf16_instructions_are_read_from_cpuinfo(tmp_path):
    from dist_infer.kernels.gemm import cpu_bf16_instructions

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n\nflags\t\t: other\n")
    assert cpu_bf16_instructions(str(info)) == ["avx512_bf16"]
    info.write_text("flags\t\t: fpu amx_bf16 amx_tile avx512_bf16\n")
    assert cpu_bf16_instructions(str(info)) == ["amx_bf16", "avx512_bf16"]
    info.write_text("flags\t\t: fpu avx2 fma\n")
    assert cpu_bf16_instructions(str(info)) == []
    assert cpu_bf16_instructions(str(tmp_path / "absent")) == []


def test_onednns_bf16_gemm_takes_bf16_inputs_and_accumulates_in_fp32():
    """What decode_stack.c calls for bf16 rows, called the same way: row-major, fp32 out."""
    import ctypes

    from dist_infer.kernels.gemm import cpu_bf16_instructions, onednn_gemm_bf16

    address = onednn_gemm_bf16()
    if address is None or not cpu_bf16_instructions():
        pytest.skip("no oneDNN or no bf16 matrix instructions here")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    gemm = ctypes.CFUNCTYPE(
        ctypes.c_int, *[ctypes.c_char] * 2, i64, i64, i64, ctypes.c_float, ptr, i64, ptr, i64, ctypes.c_float, ptr, i64
    )(address)
    torch.manual_seed(0)
    x, w = torch.randn(37, 70).bfloat16(), torch.randn(45, 70).bfloat16()
    y = torch.empty(37, 45)
    assert gemm(b"N", b"T", 37, 45, 70, 1.0, x.data_ptr(), 70, w.data_ptr(), 70, 0.0, y.data_ptr(), 45) == 0
    torch.testing.assert_close(y, x.float() @ w.float().T, atol=1e-4, rtol=1e-5)

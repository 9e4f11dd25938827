"""The ctypes signatures the Python side declares (cpu_kernels.C_SIGNATURES) against the C
prototypes (cpu_kernels.h, decode_stack.c): a mismatch would not fail a call, it would corrupt memory."""

from __future__ import annotations

import ctypes

import pytest
import torch

from dist_infer.kernels import build, load_cpu_kernels
from dist_infer.kernels.cpu_kernels import C_SIGNATURES
from tests.support.c_declarations import function_signatures, mismatches

HEADER_TEXT = build.HEADER.read_text()
STACK_TEXT = build.SOURCES[1].read_text()


def c_prototypes(header: str = HEADER_TEXT, stack: str = STACK_TEXT) -> dict:
    return {**function_signatures(header), **function_signatures(stack)}


def test_every_declared_signature_matches_its_c_prototype():
    prototypes = c_prototypes()
    assert set(C_SIGNATURES) <= set(prototypes), "a C function without a prototype the check reads"
    assert mismatches(C_SIGNATURES, prototypes) == []


def test_the_header_is_checked_against_the_definitions_by_the_compiler():
    """cpu_kernels.c includes its header, so a prototype that no longer matches its definition fails
    the build (conflicting types) instead of passing the check above with a stale header."""
    assert '#include "cpu_kernels.h"' in build.SOURCES[0].read_text()
    assert '#include "cpu_kernels.h"' in STACK_TEXT


@pytest.mark.parametrize(
    "edit, problem",
    [
        (("long K, int threads);", "long K, long threads);"), "skinny_linear: parameter 6 is c_long in C, c_int"),
        (("void rms_norm(", "int rms_norm("), "rms_norm: returns c_int in C, void in Python"),
        (
            ("long K, int threads);", "long K, int threads, int extra);"),
            "skinny_linear: 8 parameters in C, 7 in Python",
        ),
        (("float eps);", "double eps);"), "rms_norm: parameter 6 is c_double in C, c_float"),
        (("int dequantize_rows(", "int dequantize_rows_v2("), "dequantize_rows: no C prototype"),
    ],
)
def test_a_prototype_that_drifts_is_named(edit, problem):
    """The check is not vacuous: each way a prototype can drift from Python's declaration is found."""
    old, new = edit
    assert old in HEADER_TEXT
    found = mismatches(C_SIGNATURES, c_prototypes(header=HEADER_TEXT.replace(old, new, 1)))
    assert any(line.startswith(problem) for line in found), found


def test_a_drift_in_decode_stack_c_is_named():
    old = "int decode_stack(const StackLayer *layers, long n_layers,"
    assert old in STACK_TEXT
    drifted = STACK_TEXT.replace(old, "int decode_stack(const StackLayer *layers, int n_layers,")
    assert mismatches(C_SIGNATURES, c_prototypes(stack=drifted)) == [
        "decode_stack: parameter 1 is c_int in C, c_long in Python"
    ]


def test_the_loaded_functions_carry_the_declared_signatures():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the native kernels are not built")
    for name, (restype, argtypes) in C_SIGNATURES.items():
        fn = getattr(kernels, f"_{name}").fn
        assert fn.restype is restype and list(fn.argtypes) == argtypes, name
    assert isinstance(kernels.library_path, str) and kernels.library_path.endswith(".so")
    x = torch.randn(2, 16)
    w = torch.randn(8, 16)
    torch.testing.assert_close(kernels.skinny_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    assert ctypes.sizeof(ctypes.c_long) == 8  # the kernels take long as int64 (torch's int64 index tensors)

"""Which GEMM the decode stack's products go through past a few rows (prompt chunks, long steps).

oneDNN's `dnnl_sgemm` (the `onednn-cpu-gomp` wheel on x86-64 Linux) where it loads, else the
Fortran `sgemm_` of the BLAS torch was built with (MKL on x86 wheels, OpenBLAS on others). oneDNN
picks its kernels by the CPU's instruction sets; MKL picks by vendor, and on AMD's AVX-512 cores its
sgemm ran well below oneDNN's rate (docs/benchmarks.md, "oneDNN's GEMM"). Both libraries use
the OpenMP runtime torch loaded, so neither brings a second thread pool.

`DIST_INFER_STACK_GEMM=blas` (or `onednn`) picks one, for side-by-side runs; unset, the faster.

Prompt tokens may take their products in bf16 (`--prompt-dtype`): oneDNN's dnnl_gemm_bf16bf16f32,
fp32 accumulation and output, runs on the CPU's bf16 matrix instructions (Intel AMX-BF16,
AVX512-BF16 on Intel and AMD Zen 4 and later) at about twice the fp32 rate on AVX512-BF16 and more
on AMX (docs/benchmarks.md, "Prompts in bf16"); without them oneDNN emulates it, slower than fp32.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from loguru import logger

CHOICES = ("onednn", "blas")


_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ONEDNN = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_char, ctypes.c_char, _i64, _i64, _i64, _f32, _ptr, _i64, _ptr, _i64, _f32, _ptr, _i64
)
_FORTRAN = ctypes.CFUNCTYPE(None, *[_ptr] * 13)


@dataclass(frozen=True)
class StackGemm:
    """A GEMM's address and calling convention: `row_major` for oneDNN's (arguments by value,
    row-major), else BLAS's Fortran one (by reference, column-major)."""

    address: int
    row_major: bool
    name: str

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ w [N, K]^T, both fp32, contiguous, on the CPU: what the stack's products
        compute, for callers outside it (many-row linears, calibrate's GEMM rate)."""
        if (
            x.dim() != 2
            or w.dim() != 2
            or x.shape[1] != w.shape[1]
            or any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in (x, w))
        ):
            raise ValueError(
                f"{self.name} GEMM: x {list(x.shape)} and w {list(w.shape)} must be contiguous fp32 "
                "[M, K] and [N, K] on the CPU"
            )
        (M, K), N = x.shape, w.shape[0]
        if min(M, N, K) == 0:  # the libraries' argument checks refuse empty products
            return torch.zeros(M, N, dtype=torch.float32)
        y = torch.empty(M, N, dtype=torch.float32)
        if self.row_major:
            if (
                _ONEDNN(self.address)(b"N", b"T", M, N, K, 1.0, x.data_ptr(), K, w.data_ptr(), K, 0.0, y.data_ptr(), N)
                != 0
            ):
                raise ValueError(f"dnnl_sgemm refused a [{M}, {K}] x [{N}, {K}]^T product")
            return y
        c_int = ctypes.c_int  # column-major, by reference: Y^T [N, M] = W x^T
        args: list[ctypes._SimpleCData[Any]] = [
            ctypes.c_char(b"T"),
            ctypes.c_char(b"N"),
            c_int(N),
            c_int(M),
            c_int(K),
            _f32(1.0),
            c_int(K),
            c_int(K),
            _f32(0.0),
            c_int(N),
        ]
        ta, tb, n, m, k, one, ldw, ldx, zero, ldy = (ctypes.addressof(a) for a in args)
        _FORTRAN(self.address)(ta, tb, n, m, k, one, w.data_ptr(), ldw, x.data_ptr(), ldx, zero, y.data_ptr(), ldy)
        return y


def blas_sgemm() -> Optional[StackGemm]:
    """The `sgemm_` of the BLAS torch was built with, or None: what torch's own CPU GEMMs call."""
    lib_dir = Path(torch.__file__).with_name("lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            fn = getattr(ctypes.CDLL(str(lib_dir / name)), "sgemm_")
        except (OSError, AttributeError):
            continue
        address = ctypes.cast(fn, ctypes.c_void_p).value
        if address is None:  # (a symbol at NULL: nothing to call)
            continue
        return StackGemm(address, False, "blas")
    return None


def _onednn_candidates() -> list[str]:
    """Where the onednn-cpu-gomp wheel put libdnnl.so.3 (its data files: the environment's lib/,
    ~/.local/lib for a --user install; its record says which), then the environment's lib/. Only
    that wheel's: another oneDNN may be built on TBB or Intel's OpenMP, whose threads would stack
    on top of the stack's own OpenMP workers."""
    try:
        files = importlib.metadata.files("onednn-cpu-gomp") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found = [str(f.locate()) for f in files if f.name == "libdnnl.so.3"]
    return [*found, str(Path(sys.prefix) / "lib" / "libdnnl.so.3")]


def _onednn_symbol(name: str) -> Optional[tuple[int, str]]:
    """The address of oneDNN's function `name` and the library it is in, or None where no libdnnl
    loads (another platform, not installed)."""
    for path in _onednn_candidates():
        try:
            fn = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
        address = ctypes.cast(fn, ctypes.c_void_p).value
        if address is not None:  # (a symbol at NULL: nothing to call)
            return address, path
    return None


def onednn_sgemm() -> Optional[StackGemm]:
    """oneDNN's `dnnl_sgemm`, or None where no libdnnl loads."""
    found = _onednn_symbol("dnnl_sgemm")
    if found is None:
        return None
    logger.debug(f"the decode stack's GEMM: oneDNN's, from {found[1]}")
    return StackGemm(found[0], True, "onednn")


BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names for the bf16 matrix instructions


def cpu_bf16_instructions(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """Which of BF16_FLAGS this CPU has (Linux's cpuinfo; [] where it cannot be read)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in BF16_FLAGS if f in flags]


@functools.lru_cache(maxsize=None)
def onednn_gemm_bf16() -> Optional[int]:
    """The address of oneDNN's `dnnl_gemm_bf16bf16f32` (row-major, like its sgemm), or None where no
    libdnnl loads."""
    found = _onednn_symbol("dnnl_gemm_bf16bf16f32")
    return None if found is None else found[0]


def stack_gemm(choice: Optional[str] = None) -> Optional[StackGemm]:
    """The GEMM for the stack: `choice` (None: $DIST_INFER_STACK_GEMM, unset: oneDNN where it loads,
    else BLAS). None where neither is found: then the stack takes only up to MAX_ROWS rows."""
    return _stack_gemm(choice or os.environ.get("DIST_INFER_STACK_GEMM") or None)


@functools.lru_cache(maxsize=None)
def _stack_gemm(choice: Optional[str]) -> Optional[StackGemm]:
    if choice is not None and choice not in CHOICES:
        raise ValueError(f"DIST_INFER_STACK_GEMM={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice in (None, "onednn"):
        gemm = onednn_sgemm()
        if gemm is not None or choice == "onednn":
            if gemm is None:
                logger.warning("DIST_INFER_STACK_GEMM=onednn, but no libdnnl loads here: using BLAS's sgemm")
            return gemm or blas_sgemm()
    return blas_sgemm()

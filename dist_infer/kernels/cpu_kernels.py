"""The native CPU kernels (cpu_kernels.c, decode_stack.c) as torch-tensor entry points.

build.py compiles and loads the library; this module declares each C function's ctypes signature
(C_SIGNATURES, checked against the C prototypes by tests/unit/kernels/test_cpu_kernels.py: a
mismatch would corrupt memory, not fail) and wraps the calls. Whether a model uses them is the
caller's explicit choice: `use_native_kernels(module, kernels)` hands the loaded kernels (or None:
torch's ops) to every layer of a model, at build time or later in the same process (`dist-infer ...
--native-kernels off` for comparisons). They stay plain ctypes calls, not torch.library custom ops:
the dispatcher's cost per call is more than a small kernel's own time, and a decode step makes
hundreds of calls; each call is a named profiler range instead.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

from dist_infer.kernels.decode_stack import Bf16Rows, DecodeStackPlan, DecodeStep
from dist_infer.kernels.gemm import onednn_gemm_bf16, stack_gemm

MAX_ROWS = 8  # skinny_linear handles 1..MAX_ROWS rows of x
_f32, _int = ctypes.c_float, ctypes.c_int
_ptr, _long = ctypes.c_void_p, ctypes.c_long

# name -> (restype, argtypes), as cpu_kernels.h and decode_stack.c declare them (pointers: c_void_p).
C_SIGNATURES: dict[str, tuple[Optional[type], Sequence[type]]] = {
    "skinny_linear": (_int, [_ptr] * 3 + [_long] * 3 + [_int]),
    "rms_norm": (None, [_ptr] * 4 + [_long] * 2 + [_f32]),
    "rope_cache_write": (None, [_ptr] * 3 + [_long] * 3 + [_ptr] * 5 + [_long] * 4),
    "decode_attention": (_int, [_ptr] * 4 + [_long, _ptr] + [_long] * 6 + [_f32, _ptr, _ptr, _int]),
    "quant_linear": (_int, [_ptr] * 5 + [_long] * 4 + [_int, _long, _int]),
    "dequantize_rows": (_int, [_ptr] * 4 + [_long] * 3 + [_int] * 2),
    "decode_stack": (_int, [_ptr, _long, _ptr, _ptr]),
    "decode_layer_part": (_int, [_ptr, _long, _int] + [_ptr] * 4),
}


class _Named:
    """A C function that shows up under its name in a torch profile (ctypes calls otherwise don't)."""

    __slots__ = ("fn", "label")

    def __init__(self, fn, label: str):
        self.fn, self.label = fn, label

    def __call__(self, *args):
        if not torch._C._autograd._profiler_enabled():
            return self.fn(*args)
        with torch.autograd.profiler.record_function(self.label):
            return self.fn(*args)


def _dequantize_fits(
    q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], out: torch.Tensor, group_size: int, bits: int
) -> bool:
    """Whether dequantize_rows' tensors are what the C function reads and writes: on the CPU,
    contiguous, of its dtypes and of one another's shapes (a wrong one would read past a buffer)."""
    if bits not in (4, 8) or not isinstance(group_size, int) or group_size <= 0 or out.dim() != 2:
        return False
    N, K = out.shape
    if K == 0 or K % group_size or (bits == 4 and group_size % 2):
        return False
    q_dtype, q_cols = (torch.int8, K) if bits == 8 else (torch.uint8, K // 2)
    want = [(q, q_dtype, (N, q_cols)), (scales, torch.float32, (N, K // group_size)), (out, torch.float32, (N, K))] + (
        [(zeros, torch.float32, (N, K // group_size))] if zeros is not None else []
    )
    return all(
        t.device.type == "cpu" and t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous()
        for t, dtype, shape in want
    )


class CpuKernels:
    """The loaded library, with torch-tensor entry points."""

    # the C functions, one per C_SIGNATURES entry (set by _declare)
    _skinny_linear: _Named
    _rms_norm: _Named
    _rope_cache_write: _Named
    _decode_attention: _Named
    _quant_linear: _Named
    _dequantize_rows: _Named
    _decode_stack: _Named
    _decode_layer_part: _Named

    def __init__(self, lib: ctypes.CDLL, threaded: bool):
        self.threaded = threaded  # built with OpenMP: the calls split over torch's threads
        self.library_path = lib._name
        self.gemm = stack_gemm()  # products past MAX_ROWS rows, in the stack and out (None: none found)
        self.sgemm: Optional[int] = self.gemm.address if self.gemm else None
        self.sgemm_row_major = self.gemm.row_major if self.gemm else False
        self.gemm_bf16 = onednn_gemm_bf16()  # prompt rows' products in bf16 (None: no oneDNN here)
        self._declare(lib)

    def _declare(self, lib: ctypes.CDLL) -> None:
        """Each C function with its C_SIGNATURES types, as `self._<name>`, a named profiler range."""
        for name, (restype, argtypes) in C_SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, f"_{name}", _Named(fn, f"dist_infer::{name}"))

    def skinny_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight[N, K]^T for 1 <= M <= MAX_ROWS, fp32, contiguous, on the CPU."""
        M, K = x.shape
        N = weight.shape[0]
        y = torch.empty(M, N, dtype=x.dtype)
        threads = torch.get_num_threads() if self.threaded else 1
        if self._skinny_linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), M, N, K, threads) != 0:
            raise ValueError(f"skinny_linear: {M} rows is outside 1..{MAX_ROWS}")
        return y

    def quant_linear(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: Optional[torch.Tensor],
        group_size: int,
        bits: int,
    ) -> Optional[torch.Tensor]:
        """x [M, K] @ W^T for W weight-only quantized (cpu_kernels.c's quant_linear: q int8 [N, K], or
        [N, K / 2] bytes of two 4-bit values; fp32 scales / zeros [N, K / group_size]), 1 <= M <= MAX_ROWS,
        all contiguous on the CPU. None where the kernel does not take the shape (the caller uses torch)."""
        M, K = x.shape
        N = q.shape[0]
        y = torch.empty(M, N, dtype=x.dtype)
        threads = torch.get_num_threads() if self.threaded else 1
        if (
            self._quant_linear(
                x.data_ptr(),
                q.data_ptr(),
                scales.data_ptr(),
                zeros.data_ptr() if zeros is not None else None,
                y.data_ptr(),
                M,
                N,
                K,
                group_size,
                bits,
                N,
                threads,
            )
            != 0
        ):
            return None
        return y

    def dequantize_rows(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: Optional[torch.Tensor],
        out: torch.Tensor,
        group_size: int,
        bits: int,
    ) -> bool:
        """Rows of a weight-only quantized W as fp32 into `out` [N, K] (cpu_kernels.c's dequantize_rows;
        quant_linear's layouts: q int8 [N, K] for bits 8, uint8 [N, K / 2] of two 4-bit values for bits 4;
        fp32 scales / zeros [N, K / group_size]), bit for bit QuantizedWeight.dequantize's values. Row
        slices of a layer's buffers are fine (contiguous from their first row). False, `out` untouched,
        where the kernel does not take the tensors (the caller uses torch)."""
        if not _dequantize_fits(q, scales, zeros, out, group_size, bits):
            return False
        threads = torch.get_num_threads() if self.threaded else 1
        N, K = out.shape
        return (
            self._dequantize_rows(
                q.data_ptr(),
                scales.data_ptr(),
                zeros.data_ptr() if zeros is not None else None,
                out.data_ptr(),
                N,
                K,
                group_size,
                bits,
                threads,
            )
            == 0
        )

    def decode_step(
        self,
        plan: DecodeStackPlan,
        batch: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: Optional[int],
        block_size: int,
        runs: Optional[torch.Tensor] = None,
        bf16_rows: Optional[torch.Tensor] = None,
    ) -> DecodeStep:
        """A step's arguments for decode_stack / decode_layer_part, a row each (a sequence's new token,
        or one token of a prompt chunk): cos/sin [B, head_dim] of the rows' positions, their cache
        `slots` [B], block tables [B, width] and the keys each sees, seq_lens [B] (int64); `runs`
        (None: a sequence a row) the row offsets of each sequence (DecodeStep). More than MAX_ROWS
        rows need a GEMM (`self.sgemm`: oneDNN's or BLAS's, kernels/gemm.py). `bf16_rows` (bool
        [B], None: none) the rows whose linears take bf16 inputs (oneDNN's bf16 GEMM, `gemm_bf16`)."""
        if batch > MAX_ROWS and self.sgemm is None:
            raise ValueError(
                f"decode_step: {batch} rows need a BLAS sgemm, and neither oneDNN's nor torch's BLAS was found"
            )
        bf16 = None
        if bf16_rows is not None and bool(bf16_rows.any()):
            if self.gemm_bf16 is None or self.sgemm is None:
                raise ValueError("decode_step: bf16 rows need oneDNN's dnnl_gemm_bf16bf16f32, which did not load")
            bf16 = Bf16Rows(self.gemm_bf16, bf16_rows.to(torch.uint8))
        threads = torch.get_num_threads() if self.threaded else 1
        return plan.step(
            batch,
            cos,
            sin,
            slots,
            tables,
            seq_lens,
            window,
            block_size,
            threads,
            self.sgemm,
            runs,
            self.sgemm_row_major,
            bf16,
        )

    def decode_stack(self, plan: DecodeStackPlan, step: DecodeStep, x: torch.Tensor) -> torch.Tensor:
        """Rows x [B, hidden] (more than MAX_ROWS with a GEMM: decode_step) through every layer `plan`
        packs (decode_stack.c): the hidden states after the last layer, each new key and value in its
        cache slot."""
        x = self._rows(x, step)
        self._check(self._decode_stack(ctypes.addressof(plan.packed), len(plan.layers), step.address, x.data_ptr()), x)
        return x

    def decode_layer_part(
        self,
        plan: DecodeStackPlan,
        step: DecodeStep,
        layer: int,
        part: int,
        x: torch.Tensor,
        pending: Optional[torch.Tensor],
        out: torch.Tensor,
    ) -> None:
        """Half of layer `layer` (0: attention, 1: the MLP) for a tensor-parallel stage: x += pending
        (in place), then the half's partial sum into `out` [B, hidden], for the caller to all-reduce."""
        if not 0 <= layer < len(plan.layers) or part not in (0, 1):
            raise ValueError(f"decode_layer_part: layer {layer} part {part} of a plan of {len(plan.layers)} layers")
        for t in (x, pending, out):
            if t is not None and (
                not t.is_contiguous() or t.dtype != torch.float32 or tuple(t.shape) != (step.batch, plan.hidden)
            ):
                raise ValueError(f"decode_layer_part: rows must be contiguous fp32 [{step.batch}, {plan.hidden}]")
        rc = self._decode_layer_part(
            ctypes.addressof(plan.packed),
            layer,
            part,
            step.address,
            x.data_ptr(),
            pending.data_ptr() if pending is not None else None,
            out.data_ptr(),
        )
        self._check(rc, x)

    @staticmethod
    def _rows(x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        if x.dim() != 2 or tuple(x.shape) != (step.batch, step.hidden) or x.dtype != torch.float32:
            raise ValueError(
                f"decode_stack: rows {list(x.shape)} {x.dtype}, expected [{step.batch}, {step.hidden}] fp32"
            )
        return x.contiguous().clone()

    @staticmethod
    def _check(rc: int, x: torch.Tensor) -> None:
        if rc == -1:
            raise ValueError(f"decode_stack: a {list(x.shape)} step or a layer's shapes are outside what it takes")
        if rc == -3:
            raise RuntimeError(f"decode_stack: oneDNN's GEMM refused a product of a {list(x.shape)} step")
        if rc != 0:
            raise MemoryError(f"decode_stack: no memory for the work buffers of {x.shape[0]} rows")

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """HF's RMSNorm of x [T, H] (fp32, contiguous). With `residual`: x += residual in place
        first, and the sum is what is normalised."""
        out = torch.empty_like(x)
        T, H = x.shape
        self._rms_norm(
            x.data_ptr(),
            residual.data_ptr() if residual is not None else None,
            weight.data_ptr(),
            out.data_ptr(),
            T,
            H,
            eps,
        )
        return out

    def rope_cache_write(
        self,
        q: Optional[torch.Tensor],
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: Optional[torch.Tensor],
    ) -> None:
        """Rotary on q [T, heads * d] and k [T, kv_heads * d] in place; then k and v into cache `slots`.
        q=None: keys and values only; k=None: queries only.

        q, k, v may be column slices of one fused QKV output (row-strided, unit column stride)."""
        _, _, kv_heads, d = k_cache.shape
        rows = q if q is not None else k
        if rows is None:
            raise ValueError("rope_cache_write: needs the queries, the keys, or both")
        for t in (q, k, v):
            if t is not None and t.stride(-1) != 1:
                raise ValueError("rope_cache_write: rows must have unit column stride")
        self._rope_cache_write(
            q.data_ptr() if q is not None else None,
            k.data_ptr() if k is not None else None,
            v.data_ptr() if v is not None else None,
            q.stride(0) if q is not None else 0,
            k.stride(0) if k is not None else 0,
            v.stride(0) if v is not None else 0,
            cos.data_ptr(),
            sin.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr() if slots is not None else None,
            rows.shape[0],
            q.shape[1] // d if q is not None else 0,
            kv_heads if k is not None else 0,
            d,
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: Optional[int],
        scale: float,
        lse: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """One query per sequence, q [B, heads * d], against the paged cache -> [B, heads * d];
        `lse` ([B, heads] fp32, given): filled with each row's log-sum-exp (-inf: no key). The
        keys split in chunks over torch's threads (one sequence's long context too)."""
        q = q.contiguous()  # a column slice of the QKV output: rows are strided
        B = q.shape[0]
        _, block_size, kv_heads, d = k_cache.shape
        out = torch.empty_like(q)
        threads = torch.get_num_threads() if self.threaded else 1
        if (
            self._decode_attention(
                q.data_ptr(),
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                tables.data_ptr(),
                tables.shape[1],
                seq_lens.data_ptr(),
                window or 0,
                B,
                q.shape[1] // d,
                kv_heads,
                d,
                block_size,
                scale,
                out.data_ptr(),
                lse.data_ptr() if lse is not None else None,
                threads,
            )
            != 0
        ):
            raise MemoryError(f"decode_attention: no memory for the partials of {B} sequences")
        return out


def kernels_if_cpu_fp32(kernels: Optional[CpuKernels], *tensors: torch.Tensor) -> Optional[CpuKernels]:
    """`kernels` if every tensor is what they are written for (fp32 on the CPU), else None. Any
    device but the CPU is refused (CUDA, and whatever else a tensor may live on): they read host memory."""
    if kernels is None or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    return kernels


def use_native_kernels(module: torch.nn.Module, kernels: Optional[CpuKernels]) -> None:
    """Give `kernels` (None: torch's ops) to every submodule that can use them (those with a
    `kernels` attribute: the linear layers, RMSNorm, attention). The explicit switch."""
    for m in module.modules():
        if hasattr(m, "kernels"):
            setattr(m, "kernels", kernels)  # (Module's __setattr__, typed for tensors and modules only)

"""The native decode stack's arguments: every layer's weights and caches as C structures, packed
once and reused by every decode step (decode_stack.c says what the call does and why).

The plan holds the storage of every weight it points into, so no packed pointer can outlive its
memory, without a check in the step (dist_infer loads weights once; a tensor given new data
afterwards would not be seen). The KV caches it only knows by address: holding them would keep an
engine's old cache alive beside the new one it makes. Whoever builds it checks those addresses
before each step and plans again when a cache was replaced (models/fused_decode.py)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch

_ptr, _long = ctypes.c_void_p, ctypes.c_long


class _Linear(ctypes.Structure):
    _fields_ = [
        ("w", _ptr),
        ("scales", _ptr),
        ("zeros", _ptr),
        ("n", _long),
        ("k", _long),
        ("group", _long),
        ("bits", _long),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("batch", _long),
        ("hidden", _long),
        ("q_heads", _long),
        ("kv_heads", _long),
        ("head_dim", _long),
        ("intermediate", _long),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("tables", _ptr),
        ("seq_lens", _ptr),
        ("table_width", _long),
        ("window", _long),
        ("block_size", _long),
        ("threads", _long),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("sgemm", _ptr),
        ("n_runs", _long),
        ("runs", _ptr),
        ("sgemm_row_major", _long),
        ("gemm_bf16", _ptr),
        ("bf16_rows", _ptr),
    ]


@dataclass
class StackLinear:
    """One linear layer as the kernels read it: an fp32 weight [n, k] (bits 32), or quant_linear's
    integers with their scales and zeros (bits 8 or 4, groups of `group` columns)."""

    weight: torch.Tensor
    n: int
    k: int
    scales: Optional[torch.Tensor] = None
    zeros: Optional[torch.Tensor] = None
    group: int = 0
    bits: int = 32

    def packed(self) -> _Linear:
        return _Linear(
            self.weight.data_ptr(), _address(self.scales), _address(self.zeros), self.n, self.k, self.group, self.bits
        )


@dataclass
class StackLayer:
    """A decoder layer's norms and linears, and its KV cache's addresses (data_ptr of K and V)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: StackLinear
    o: StackLinear
    gate_up: StackLinear
    down: StackLinear
    k_cache: int
    v_cache: int

    def weights(self) -> list[torch.Tensor]:
        linears = (self.qkv, self.o, self.gate_up, self.down)
        return [
            self.input_norm,
            self.post_norm,
            *(t for L in linears for t in (L.weight, L.scales, L.zeros) if t is not None),
        ]


def _address(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class DecodeStackPlan:
    """Layers packed for `CpuKernels.decode_stack`, with the model's dimensions."""

    def __init__(
        self,
        layers: list[StackLayer],
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        hidden: int,
        intermediate: int,
        eps: float,
        scale: float,
    ):
        self.layers = layers  # what the packed pointers point into
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.hidden, self.intermediate, self.eps, self.scale = hidden, intermediate, eps, scale
        self.packed = (_Layer * len(layers))(
            *[
                _Layer(
                    L.input_norm.data_ptr(),
                    L.post_norm.data_ptr(),
                    L.qkv.packed(),
                    L.o.packed(),
                    L.gate_up.packed(),
                    L.down.packed(),
                    L.k_cache,
                    L.v_cache,
                )
                for L in layers
            ]
        )
        self._storages = [t.untyped_storage() for L in layers for t in L.weights()]  # alive while packed

    def step(
        self,
        batch: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window: Optional[int],
        block_size: int,
        threads: int,
        sgemm: Optional[int] = None,
        runs: Optional[torch.Tensor] = None,
        sgemm_row_major: bool = False,
        bf16: Optional["Bf16Rows"] = None,
    ) -> "DecodeStep":
        return DecodeStep(
            self,
            batch,
            cos,
            sin,
            slots,
            tables,
            seq_lens,
            window,
            block_size,
            threads,
            sgemm,
            runs,
            sgemm_row_major,
            bf16,
        )


@dataclass(frozen=True)
class Bf16Rows:
    """The rows of a step whose linears take bf16 inputs (uint8 [batch], 1: bf16), and the address
    of oneDNN's dnnl_gemm_bf16bf16f32 that multiplies them (kernels/gemm.py)."""

    gemm: int
    rows: torch.Tensor


class DecodeStep:
    """One step's arguments as the C structure, holding the (contiguous) tensors it points into. A
    row is a query of its own: its rotary angles, cache slot, block table and the keys it sees (its
    position + 1). `sgemm`: a GEMM's address, for steps of more than MAX_ROWS rows: BLAS's sgemm_, or
    oneDNN's dnnl_sgemm where `sgemm_row_major` (kernels/gemm.py). `runs`
    (int64 [sequences + 1], None: a sequence a row): rows runs[i]..runs[i + 1] are one sequence's,
    and a long run (a prompt chunk) attends in two GEMMs instead of row by row. `bf16` (None: every
    row fp32): the rows whose linears' products take bf16 inputs, and the GEMM for them."""

    def __init__(
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
        threads: int,
        sgemm: Optional[int] = None,
        runs: Optional[torch.Tensor] = None,
        sgemm_row_major: bool = False,
        bf16: Optional[Bf16Rows] = None,
    ):
        self.batch, self.hidden = batch, plan.hidden
        self.tensors = [t.contiguous() for t in (cos, sin, slots, tables, seq_lens)]
        cos, sin, slots, tables, seq_lens = self.tensors
        if (
            cos.dtype != torch.float32
            or sin.dtype != torch.float32
            or any(t.dtype != torch.int64 for t in (slots, tables, seq_lens))
        ):
            raise ValueError("decode step: cos/sin must be fp32, slots, tables and seq_lens int64")
        if (
            cos.shape != (batch, plan.head_dim)
            or sin.shape != cos.shape
            or slots.shape != (batch,)
            or seq_lens.shape != (batch,)
            or tables.dim() != 2
            or tables.shape[0] != batch
        ):
            raise ValueError(f"decode step: arguments do not describe {batch} sequences of head_dim {plan.head_dim}")
        if runs is not None:
            runs = runs.contiguous()
            if (
                runs.dtype != torch.int64
                or runs.dim() != 1
                or runs.numel() < 2
                or int(runs[0]) != 0
                or int(runs[-1]) != batch
                or bool((runs[1:] < runs[:-1]).any())
            ):
                raise ValueError(f"decode step: runs must be int64 row offsets from 0 to {batch}, ascending")
            self.tensors.append(runs)
        if bf16 is not None:
            if bf16.rows.dtype != torch.uint8 or tuple(bf16.rows.shape) != (batch,) or not sgemm:
                raise ValueError(f"decode step: bf16 rows must be uint8 [{batch}], beside an fp32 GEMM")
            self.tensors.append(bf16.rows.contiguous())
        self.struct = _Step(
            batch,
            plan.hidden,
            plan.q_heads,
            plan.kv_heads,
            plan.head_dim,
            plan.intermediate,
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            seq_lens.data_ptr(),
            tables.shape[1],
            window or 0,
            block_size,
            threads,
            plan.eps,
            plan.scale,
            sgemm,
            0 if runs is None else runs.numel() - 1,
            None if runs is None else runs.data_ptr(),
            int(sgemm_row_major),
            None if bf16 is None else bf16.gemm,
            None if bf16 is None else self.tensors[-1].data_ptr(),
        )
        self.address = ctypes.addressof(self.struct)

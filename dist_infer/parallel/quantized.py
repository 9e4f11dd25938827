"""Weights held as integers in groups along the input dimension (weight-only quantization).

One representation for every source: GGUF blocks (Q8_0 -> 8 bits, Q4_0 / Q4_1 -> 4 bits, groups
of 32, converted block for block), or a float checkpoint quantized at load. A value is

    w[o, i] = scales[o, i // group_size] * q[o, i] + zeros[o, i // group_size]

(zeros None: 0). Layers narrow a QuantizedWeight to their shard like a float tensor; the kernels
that compute with it live beside the linear layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class QuantizedWeight:
    """A 2-D weight [out, in] as integers `q` (int8; 4-bit values stored one per int8 byte, 0..15
    or -8..7 as the source has them) with fp32 `scales` and optional fp32 `zeros`, one per group."""

    q: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out, ceil(in / group_size)]
    zeros: Optional[torch.Tensor]  # float32 like scales, or None (symmetric)
    group_size: int
    bits: int  # 8 or 4

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.q.dim() != 2 or self.q.dtype != torch.int8:
            raise ValueError(f"q must be a 2-D int8 tensor, got {self.q.dtype} {list(self.q.shape)}")
        groups = -(-self.q.shape[1] // self.group_size)
        if tuple(self.scales.shape) != (self.q.shape[0], groups):
            raise ValueError(f"scales have shape {list(self.scales.shape)}, expected {[self.q.shape[0], groups]}")
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError(f"zeros have shape {list(self.zeros.shape)}, expected {list(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight these integers stand for (the reference every kernel is checked against)."""
        cols = self.q.shape[1]
        scales = self.scales.repeat_interleave(self.group_size, dim=1)[:, :cols]
        w = self.q.to(torch.float32) * scales
        if self.zeros is not None:
            w = w + self.zeros.repeat_interleave(self.group_size, dim=1)[:, :cols]
        return w.to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedWeight":
        """Rows (dim 0) or columns (dim 1) of the weight. Columns must start on a group boundary
        (a shard that cuts a group is the caller's to handle)."""
        if dim == 0:
            z = None if self.zeros is None else self.zeros[start : start + length]
            return QuantizedWeight(
                self.q[start : start + length], self.scales[start : start + length], z, self.group_size, self.bits
            )
        if dim != 1:
            raise ValueError(f"a 2-D weight has dims 0 and 1, got {dim}")
        if start % self.group_size:
            raise ValueError(f"columns {start}..{start + length} cut a group of {self.group_size}")
        g0, g1 = start // self.group_size, -(-(start + length) // self.group_size)
        z = None if self.zeros is None else self.zeros[:, g0:g1]
        return QuantizedWeight(self.q[:, start : start + length], self.scales[:, g0:g1], z, self.group_size, self.bits)

    def pad_rows(self, rows: int) -> "QuantizedWeight":
        """The weight with zero rows appended up to `rows` (their outputs are 0): a vocabulary shard's
        padding, or the int4 kernel's multiple of 16 output rows."""
        extra = rows - self.q.shape[0]
        if extra <= 0:
            return self
        z = None if self.zeros is None else torch.cat([self.zeros, self.zeros.new_zeros(extra, self.zeros.shape[1])])
        return QuantizedWeight(
            torch.cat([self.q, self.q.new_zeros(extra, self.q.shape[1])]),
            torch.cat([self.scales, self.scales.new_zeros(extra, self.scales.shape[1])]),
            z,
            self.group_size,
            self.bits,
        )

    def unsigned_int4(self) -> "QuantizedWeight":
        """The same 4-bit values with q in 0..15 and explicit zeros: a source's signed -8..7 integers
        shift by 8 (the zero absorbs it), so parts of either kind can be stacked and packed."""
        if self.bits != 4:
            raise ValueError(f"unsigned_int4 needs a 4-bit weight, got {self.bits} bits")
        zeros = self.zeros if self.zeros is not None else torch.zeros_like(self.scales)
        if self.q.numel() == 0 or int(self.q.min()) >= 0:
            return QuantizedWeight(self.q, self.scales, zeros, self.group_size, 4)
        return QuantizedWeight(self.q + 8, self.scales, zeros - 8 * self.scales, self.group_size, 4)


def stack_rows(parts: Sequence[QuantizedWeight]) -> Optional[QuantizedWeight]:
    """Row blocks of one weight (q, k and v; gate and up) as one weight, or None where they are not
    of one kind (other group sizes or bit widths), which the caller then holds as floats."""
    first = parts[0]
    if any(p.group_size != first.group_size or p.bits != first.bits or p.shape[1] != first.shape[1] for p in parts):
        return None
    if first.bits == 4:
        parts = [p.unsigned_int4() for p in parts]
    if all(p.zeros is None for p in parts):
        zeros = None
    else:
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.zeros_like(p.scales) for p in parts])
    return QuantizedWeight(
        torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), zeros, first.group_size, first.bits
    )


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [out, in] as [out, groups, group_size], a last partial group filled with its row's last
    value (which changes neither its minimum nor its maximum)."""
    w = w.to(torch.float32)
    extra = -w.shape[1] % group_size
    if extra:
        w = torch.cat([w, w[:, -1:].expand(-1, extra)], dim=1)
    return w.reshape(w.shape[0], -1, group_size)


def quantize_int8(w: torch.Tensor, group_size: Optional[int] = None) -> QuantizedWeight:
    """Symmetric int8 (q in -127..127, no zeros), one scale per row (`group_size` None: the int8
    kernel's per-output-channel layout) or per group of columns."""
    group_size = group_size or max(int(w.shape[1]), 1)
    g = _groups(w, group_size)
    scales = g.abs().amax(dim=2) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(g / safe.unsqueeze(2)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.reshape(w.shape[0], -1)[:, : w.shape[1]].contiguous(), scales, None, group_size, 8)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric 4-bit (q in 0..15) per group of columns: scale (max - min) / 15 and zero = min,
    so each group's extremes are exact and every value is within half a step."""
    g = _groups(w, group_size)
    low, high = g.amin(dim=2), g.amax(dim=2)
    scales = (high - low) / 15.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - low.unsqueeze(2)) / safe.unsqueeze(2)).clamp_(0, 15).to(torch.int8)
    return QuantizedWeight(q.reshape(w.shape[0], -1)[:, : w.shape[1]].contiguous(), scales, low, group_size, 4)

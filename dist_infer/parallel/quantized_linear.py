"""Computing with weight-only quantized shards: torch's CPU int8 and int4 kernels, and what a
layer does when neither applies.

A layer asked for quantization (`--quantization`) reads each row block of its shard as a
QuantizedWeight (the source's own blocks where it has them, `quantized_slice`; else the float
shard quantized here), stacks its parts, and packs the result for one kernel:

- int8, one scale per output row, no zeros: `aten._weight_int8pack_mm` (weight kept as int8);
- 4-bit with groups of 32/64/128/256 that tile the shard's columns: `aten._weight_int4pack_mm_for_cpu`
  (two values a byte; that kernel computes (q - 8) * scale + zero, so zero' = zero + 8 * scale).

With the native CPU kernels and fp32, any int8 or 4-bit shard in groups of a multiple of 32 that
tile its columns (GGUF Q8_0 and Q4_x too) goes to `GroupQuantLinear` instead: the decode step's
few rows through cpu_kernels.c's `quant_linear`, which streams the integers and widens them in
registers; torch's kernels stream them slower than fp32 on the CPUs measured (docs/benchmarks.md,
"Weights that stay quantized"). Larger batches
dequantize a block of rows at a time into F.linear.

Anything else (a group no kernel takes, a row-parallel shard that cuts a group) is dequantized once
into a float weight, with a warning naming the layer.

A vocabulary shard can also be held for an embedding (`pack_lookup`, `pack_tied`): the packed
forms with a `lookup(ids)` dequantize just the rows asked for, with the arithmetic of
`QuantizedWeight.dequantize`, so the embedding sees the very values of the dequantized table and
no float table is kept; a tied LM head computes with the same module.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from loguru import logger
from torch import nn

from dist_infer.kernels import MAX_ROWS
from dist_infer.parallel.quantized import QuantizedWeight, quantize_int4, quantize_int8, stack_rows

SCHEMES = ("auto", "int8", "int4", "none")
INT4_GROUP_SIZE = 32
INT4_KERNEL_GROUPS = (32, 64, 128, 256)
INT4_ROW_MULTIPLE = 16  # the int4 packing takes output rows in multiples of 16
NATIVE_GROUP_MULTIPLE = 32  # quant_linear's groups: whole vectors of values (two for packed 4-bit)
NATIVE_MAX_ROWS = 64  # up to this many rows the native kernel runs in tiles of MAX_ROWS; past it, dequantize
DEQUANTIZE_ROWS = 4096  # output rows dequantized at a time on the torch path
QUANTIZE_ROWS = 4096  # rows of a float source read and quantized at a time

Block = Union[QuantizedWeight, torch.Tensor]


class QuantizationError(ValueError):
    """A --quantization this model or device cannot run."""


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise QuantizationError(f"--quantization {scheme!r}: one of {', '.join(SCHEMES)}")
    return scheme


def _kernel_fits(qw: QuantizedWeight, scheme: str) -> bool:
    """Whether a source's own blocks already suit `scheme`'s kernel (then they are kept exactly)."""
    cols = qw.shape[1]
    if scheme == "int8":
        return qw.bits == 8 and qw.zeros is None and qw.group_size >= cols
    return qw.bits == 4 and qw.group_size in INT4_KERNEL_GROUPS and cols % qw.group_size == 0


def quantize_as(w: torch.Tensor, scheme: str) -> QuantizedWeight:
    """A float block quantized with `scheme` ('int8': per output row; 'int4': groups of 32)."""
    w = w.to(torch.float32)
    return quantize_int8(w) if scheme == "int8" else quantize_int4(w, INT4_GROUP_SIZE)


def read_block(source, rows: slice, cols: slice, scheme: str, name: str) -> Block:
    """Rows x columns of a full weight `source`, as `scheme` wants them held.

    'auto' keeps a quantized source's blocks and a float source's floats; 'int8' / 'int4' keep
    the source's blocks where they suit the kernel and otherwise quantize the float values of
    this block only (a rank never reads more than its shard). A source whose `quantized_slice`
    refuses the slice (ValueError: it cuts a group) is read as floats."""
    quantized = None
    if hasattr(source, "quantized_slice"):
        try:
            quantized = source.quantized_slice(rows, cols)
        except ValueError as exc:
            logger.warning(f"{name}: the shard cannot be taken in whole quantized groups ({exc}); it is held as floats")
    if scheme == "auto":
        return quantized if quantized is not None else source[rows, cols]
    if quantized is not None and _kernel_fits(quantized, scheme):
        return quantized
    r0, r1, _ = rows.indices(int(source.shape[0]))
    parts = []
    for a in range(r0, r1, QUANTIZE_ROWS):  # a block of rows at a time: no float copy of the whole shard
        b = min(a + QUANTIZE_ROWS, r1)
        w = quantized.narrow(0, a - r0, b - a).dequantize() if quantized is not None else source[slice(a, b), cols]
        parts.append(quantize_as(w, scheme))
    return parts[0] if len(parts) == 1 else stack_rows(parts)


def merge_blocks(blocks: Sequence[Block], name: str) -> Block:
    """A layer's row blocks (its parts, in order) as one weight: stacked quantized where they are
    all quantized alike, else all as floats."""
    if all(isinstance(b, QuantizedWeight) for b in blocks):
        stacked = stack_rows(blocks)
        if stacked is not None:
            return stacked
        logger.warning(
            f"{name}: its parts are quantized differently "
            f"({sorted({(b.bits, b.group_size) for b in blocks})} bits/group); held as floats"
        )
    return torch.cat([b.dequantize() if isinstance(b, QuantizedWeight) else b.to(torch.float32) for b in blocks])


def _rows2d(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k).contiguous()


class Int8Linear(nn.Module):
    """x W^T with W int8 and one scale per output row (torch's `_weight_int8pack_mm`)."""

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.register_buffer("q", qw.q.contiguous())
        self.register_buffer("scales", qw.scales[:, 0].to(dtype).contiguous())

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_rows2d(x, self.in_features), self.q, self.scales)
        return y.reshape(*x.shape[:-1], self.out_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (an embedding's lookup): q * scale, in the scales' dtype."""
        return self.q[ids].to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)


class Int4Linear(nn.Module):
    """x W^T with W packed two 4-bit values a byte, a scale and a zero per group of columns
    (torch's `_weight_int4pack_mm_for_cpu`)."""

    def __init__(self, qw: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.group_size = qw.group_size
        qw = qw.unsigned_int4().pad_rows(-(-self.out_features // INT4_ROW_MULTIPLE) * INT4_ROW_MULTIPLE)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32).contiguous(), 1)
        zeros = qw.zeros + 8 * qw.scales  # the kernel's (q - 8) * scale + zero
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", torch.stack([qw.scales.t(), zeros.t()], dim=-1).to(dtype).contiguous())

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            _rows2d(x, self.in_features), self.packed, self.group_size, self.scales_and_zeros
        )
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)


class FloatLinear(nn.Module):
    """A float weight where no kernel applies (its layer may then use its own float path)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        return F.linear(x, self.weight)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def _pack_nibbles(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """4-bit values 0..15 [N, K] -> bytes [N, K / 2]: in each group, byte j holds value j (low
    nibble) and value j + group_size / 2 (high nibble), quant_linear's layout."""
    n = q.shape[0]
    g = q.to(torch.uint8).reshape(n, -1, 2, group_size // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, -1).contiguous()


class GroupQuantLinear(nn.Module):
    """x W^T for an fp32 model with W int8 or packed 4-bit in groups (a multiple of 32 values)
    with scales and optional zeros: the native `quant_linear` for up to NATIVE_MAX_ROWS rows,
    else blocks of rows dequantized into the kernels' GEMM (F.linear without native kernels)."""

    def __init__(self, qw: QuantizedWeight):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.group_size, self.bits = qw.group_size, qw.bits
        if qw.bits == 4:
            qw = qw.unsigned_int4()
        q = qw.q.contiguous() if qw.bits == 8 else _pack_nibbles(qw.q, qw.group_size)
        self.register_buffer("q", q)
        self.register_buffer("scales", qw.scales.to(torch.float32).contiguous())
        self.register_buffer("zeros", None if qw.zeros is None else qw.zeros.to(torch.float32).contiguous())

    def _dequantize(self, q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor]) -> torch.Tensor:
        """Rows of W as fp32 from their q bytes, scales and zeros: q * scale, then + zero, as
        QuantizedWeight.dequantize rounds them."""
        n, g = q.shape[0], self.group_size
        if self.bits == 4:
            b = q.reshape(n, -1, g // 2)
            q = torch.cat([b & 15, b >> 4], dim=2)
        w = q.reshape(n, -1, g).to(torch.float32) * scales[:, :, None]
        if zeros is not None:
            w += zeros[:, :, None]
        return w.reshape(n, self.in_features)

    def dequantized_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop of W as fp32 (the torch path)."""
        zeros = None if self.zeros is None else self.zeros[start:stop]
        return self._dequantize(self.q[start:stop], self.scales[start:stop], zeros)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of W as fp32 (an embedding's lookup): only those rows are read."""
        flat = ids.reshape(-1)
        zeros = None if self.zeros is None else self.zeros[flat]
        return self._dequantize(self.q[flat], self.scales[flat], zeros).reshape(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        x2 = _rows2d(x, self.in_features)
        rows = x2.shape[0]
        y = None
        if kernels is not None and 1 <= rows <= NATIVE_MAX_ROWS and x2.dtype == torch.float32:
            tiles = [
                kernels.quant_linear(x2[i : i + MAX_ROWS], self.q, self.scales, self.zeros, self.group_size, self.bits)
                for i in range(0, rows, MAX_ROWS)
            ]
            y = None if any(t is None for t in tiles) else torch.cat(tiles) if len(tiles) > 1 else tiles[0]
        if y is None:
            y = x2.new_empty(rows, self.out_features)
            buffer = None
            if kernels is not None and x2.dtype == torch.float32:  # one pass in C into a reused block
                buffer = x2.new_empty(min(DEQUANTIZE_ROWS, self.out_features), self.in_features)
            gemm = kernels.gemm if buffer is not None and x2.is_contiguous() else None  # kernels/gemm.py
            for start in range(0, self.out_features, DEQUANTIZE_ROWS):
                stop = min(start + DEQUANTIZE_ROWS, self.out_features)
                w = self._rows_for_gemm(start, stop, buffer, kernels).to(x2.dtype)
                y[:, start:stop] = gemm.linear(x2, w) if gemm is not None and w.is_contiguous() else F.linear(x2, w)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _rows_for_gemm(self, start: int, stop: int, buffer: Optional[torch.Tensor], kernels) -> torch.Tensor:
        """Rows start..stop of W as fp32 for a GEMM: the native dequantize_rows into `buffer` (the
        same values as the torch path, bit for bit), else the torch path."""
        if buffer is not None:
            out = buffer[: stop - start]
            zeros = None if self.zeros is None else self.zeros[start:stop]
            if kernels.dequantize_rows(
                self.q[start:stop], self.scales[start:stop], zeros, out, self.group_size, self.bits
            ):
                return out
        return self.dequantized_rows(start, stop)


def _native_fits(qw: QuantizedWeight, dtype: torch.dtype) -> bool:
    cols = qw.shape[1]
    return dtype == torch.float32 and qw.group_size % NATIVE_GROUP_MULTIPLE == 0 and cols % qw.group_size == 0


def _no_kernel_reason(qw: QuantizedWeight, dtype: torch.dtype) -> Optional[str]:
    cols = qw.shape[1]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {dtype} has no quantized kernel"
    if qw.bits == 8:
        if qw.zeros is not None or qw.group_size < cols:
            return f"int8 in groups of {qw.group_size} (the int8 kernel takes one scale per output row, no zeros)"
        return None
    if qw.group_size not in INT4_KERNEL_GROUPS:
        return f"4-bit groups of {qw.group_size} (the int4 kernel takes {INT4_KERNEL_GROUPS})"
    if cols % qw.group_size or cols % 2:
        return f"{cols} input columns are not whole groups of {qw.group_size}"
    return None


def pack_block(
    block: Block, dtype: torch.dtype, name: str, rows: Optional[int] = None, native: bool = False
) -> nn.Module:
    """The compute form of a layer's whole shard: GroupQuantLinear (`native`: the layer has the
    native CPU kernels), Int8Linear / Int4Linear, or a FloatLinear (dequantized once, with a
    warning) where no kernel applies. `rows`: pad the output to this many rows (zero rows: a
    vocabulary shard's padding)."""
    if isinstance(block, torch.Tensor):
        w = block.to(dtype)
        if rows is not None and rows > w.shape[0]:
            w = torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])])
        return FloatLinear(w.contiguous())
    if rows is not None:
        block = block.pad_rows(rows)
    if native and _native_fits(block, dtype):
        return GroupQuantLinear(block)
    reason = _no_kernel_reason(block, dtype)
    if reason is None:
        return Int8Linear(block, dtype) if block.bits == 8 else Int4Linear(block, dtype)
    logger.warning(f"{name}: no quantized kernel for {reason}; dequantized into a {dtype} weight")
    return FloatLinear(block.dequantize(dtype).contiguous())


def _lookup_fits(qw: QuantizedWeight) -> bool:
    """Whether GroupQuantLinear can hold the weight (whole groups a row; 4-bit groups of an even size)."""
    return qw.shape[1] % qw.group_size == 0 and (qw.bits == 8 or qw.group_size % 2 == 0)


def pack_lookup(block: Block, dtype: torch.dtype, name: str, rows: Optional[int] = None) -> nn.Module:
    """A vocabulary shard held for an embedding's row lookups: a GroupQuantLinear keeps the
    integers (any dtype: a row is dequantized when looked up), else the floats (FloatLinear)."""
    if isinstance(block, QuantizedWeight):
        block = block.pad_rows(rows) if rows is not None else block
        if _lookup_fits(block):
            return GroupQuantLinear(block)
        logger.warning(
            f"{name}: {block.bits}-bit groups of {block.group_size} do not tile {block.shape[1]} columns; "
            f"dequantized into a {dtype} table"
        )
        block = block.dequantize(dtype)
    return pack_block(block, dtype, name, rows)


def pack_tied(
    block: Block, dtype: torch.dtype, name: str, rows: Optional[int] = None, native: bool = False
) -> tuple[nn.Module, nn.Module]:
    """(the embedding's, the tied LM head's) forms of one vocabulary shard: one module for both
    where the head's form can also look rows up (GroupQuantLinear, Int8Linear, floats); beside
    torch's packed int4, whose layout cannot be indexed, the embedding keeps a GroupQuantLinear."""
    head = pack_block(block, dtype, name, rows, native)
    table = head if hasattr(head, "lookup") else pack_lookup(block, dtype, name, rows)
    return table, head


class QuantizedShard:
    """Collects a layer's row blocks while it loads and packs them once all its parts are in.

    `parts`: how many row blocks (weight loader calls) make the shard; `rows`: pad to this many
    output rows (None: as loaded)."""

    def __init__(self, scheme: str, dtype: torch.dtype, name: str, parts: int, rows: Optional[int] = None):
        self.scheme, self.dtype, self.name = check_scheme(scheme), dtype, name
        self.parts, self.rows = parts, rows
        self.blocks: dict[int, Block] = {}

    def add(
        self, source, rows: slice, cols: slice, offset: int, label: str, native: bool = False
    ) -> Optional[nn.Module]:
        """Read one part (at output row `offset` of the shard); the packed shard once it is the last
        (`native`: for the native CPU kernels, see pack_block)."""
        self.blocks[offset] = read_block(source, rows, cols, self.scheme, label)
        if len(self.blocks) < self.parts:
            return None
        blocks = [self.blocks[k] for k in sorted(self.blocks)]
        self.blocks = {}
        return pack_block(merge_blocks(blocks, self.name), self.dtype, self.name, self.rows, native)

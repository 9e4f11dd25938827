"""GGUF quantized blocks as `QuantizedWeight`s, so a quantized file stays quantized in memory.

Most GGUF types hold each run of 32 values as small integers with one scale (and maybe one
offset), which is `QuantizedWeight`'s form with groups of 32; those convert block for block, the
integers unpacked from the file's bytes with numpy and the scales widened to fp32, with no float
weight in between (value = scale * q + zero):

    Q8_0  q int8 as stored         scale d            zero None      (8 bits)
    Q4_0  q the nibble 0..15       scale d            zero -8 * d    (4 bits)
    Q4_1  q the nibble 0..15       scale d            zero m         (4 bits)
    Q5_0  q 0..31 minus 16         scale d            zero None      (held as 8 bits)
    Q5_1  q 0..31                  scale d            zero m         (held as 8 bits)
    Q4_K  q 0..15 per sub-block    scale d * sc       zero -dmin * m (4 bits)
    Q5_K  q 0..31 per sub-block    scale d * sc       zero -dmin * m (held as 8 bits)

(In a Q4/Q5 block the low nibbles of the packed bytes are the first values, the high nibbles the
next ones: llama.cpp's order.) `QuantizedWeight.dequantize` of the result equals the gguf package's
dequantization bit for bit: the scales are computed as gguf computes them, every product
scale * q is exact in fp32, and x + (-y) rounds as x - y does. The one difference: Q4_0's exact
zeros come out +0.0 where gguf gives -0.0 for a negative scale.

Q2_K, Q3_K and Q6_K scale sub-blocks of 16 values, so a group of 32 holds two scales; they are
dequantized and requantized per group of 32 (`requantize`): Q6_K to int8 (symmetric), Q2_K and
Q3_K to 4 bits (asymmetric; the source has at most 3 bits a value, and 4 bits is the form a
kernel takes). `quantization_error` measures what that costs against the file's own values.
"""

from __future__ import annotations

import numpy as np
import torch

from dist_infer.parallel.quantized import QuantizedWeight, quantize_int4, quantize_int8

GROUP = 32  # values per group of every converted or requantized weight
EXACT_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q5_1": 8, "Q4_K": 4, "Q5_K": 8}
REQUANT_BITS = {"Q6_K": 8, "Q3_K": 4, "Q2_K": 4}
# values and bytes per block
BLOCKS = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
}


def quantization_of_type(type_name: str) -> str | None:
    """ "int8" / "int4": what `GGUFTensor.quantized_slice` gives for a tensor of this GGUF type; None: a float type."""
    bits = EXACT_BITS.get(type_name) or REQUANT_BITS.get(type_name)
    return None if bits is None else f"int{bits}"


def _fp16(b: np.ndarray, at: int) -> np.ndarray:
    """The little-endian fp16 at byte `at` of every block of b [rows, blocks, bytes], as fp32 [rows, blocks, 1]."""
    bits = b[..., at].astype(np.uint16) | (b[..., at + 1].astype(np.uint16) << np.uint16(8))
    return bits.view(np.float16).astype(np.float32)[..., None]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Packed bytes [..., k] -> [..., 2k] values 0..15: the low nibbles first, then the high ones."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """Bytes [..., k] -> [..., 8k] bits, bit j of byte i at index 8i + j (a little-endian bit field)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums -> (sc, m), each [..., 8] as fp32."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mins.astype(np.float32)


def _decode(b: np.ndarray, type_name: str):
    """(q [rows, blocks, values], scales, zeros or None [rows, blocks, groups]) of blocks b [rows, blocks, bytes]."""
    if type_name == "Q8_0":
        return b[..., 2:].view(np.int8), _fp16(b, 0), None
    if type_name == "Q4_0":
        d = _fp16(b, 0)
        return _nibbles(b[..., 2:]), d, np.float32(-8.0) * d
    if type_name == "Q4_1":
        return _nibbles(b[..., 4:]), _fp16(b, 0), _fp16(b, 2)
    if type_name == "Q5_0":
        q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << np.uint8(4))
        return q.view(np.int8) - np.int8(16), _fp16(b, 0), None
    if type_name == "Q5_1":
        return _nibbles(b[..., 8:]) | (_bits(b[..., 4:8]) << np.uint8(4)), _fp16(b, 0), _fp16(b, 2)
    # Q4_K / Q5_K: 8 sub-blocks of 32; 32 bytes of nibbles hold sub-block 2j (low) and 2j + 1 (high)
    sc, m = _k_scales(b[..., 4:16])
    scales, zeros = _fp16(b, 0) * sc, -(_fp16(b, 2) * m)
    qs = b[..., 16:] if type_name == "Q4_K" else b[..., 48:]
    q = _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 256)
    if type_name == "Q5_K":  # bit i of byte p: the fifth bit of value p of sub-block i
        high = _bits(b[..., 16:48]).reshape(*b.shape[:-1], 32, 8).swapaxes(-1, -2).reshape(*b.shape[:-1], 256)
        q = q | (high << np.uint8(4))
    return q, scales, zeros


def blocks_to_weight(raw: np.ndarray, type_name: str, start: int, cols: int) -> QuantizedWeight:
    """The QuantizedWeight of columns start..start+cols of raw blocks [rows, blocks * block bytes] (whole blocks
    of each row, in order); `start` (from the first block's first value) must be a multiple of 32."""
    if type_name not in BLOCKS:
        raise ValueError(f"{type_name} blocks do not convert exactly; one of {sorted(BLOCKS)}")
    values, size = BLOCKS[type_name]
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"{type_name} rows are whole {size}-byte blocks; got bytes of shape {list(raw.shape)}")
    rows, blocks = raw.shape[0], raw.shape[1] // size
    if start % GROUP or not 0 < cols <= blocks * values - start:
        raise ValueError(
            f"columns {start}..{start + cols} of {blocks} blocks of {values}: the start must be a "
            f"multiple of {GROUP} and the end inside the blocks"
        )
    q, scales, zeros = _decode(raw.reshape(rows, blocks, size), type_name)
    g0, g1 = start // GROUP, -(-(start + cols) // GROUP)

    def groups(x: np.ndarray) -> torch.Tensor:
        x = np.broadcast_to(x, (rows, blocks, values // GROUP)).reshape(rows, -1)
        return torch.from_numpy(np.array(x[:, g0:g1], dtype=np.float32, order="C"))  # a copy: x may be read-only

    q = torch.from_numpy(np.ascontiguousarray(q.reshape(rows, -1)[:, start : start + cols]).view(np.int8))
    return QuantizedWeight(q, groups(scales), None if zeros is None else groups(zeros), GROUP, EXACT_BITS[type_name])


def requantize(values: torch.Tensor, bits: int, group: int = GROUP) -> QuantizedWeight:
    """fp32 values [rows, cols] as integers per `group` columns (the last group may be short), rounded to nearest:
    bits 8: symmetric, q in -127..127, scale absmax / 127, no zeros;
    bits 4: asymmetric, q in 0..15, scale (max - min) / 15, zero min.
    The same quantizers a layer uses for a float checkpoint (parallel.quantized)."""
    if values.dim() != 2:
        raise ValueError(f"requantize takes a matrix, got shape {list(values.shape)}")
    if bits not in (4, 8) or group < 1:
        raise ValueError(f"bits must be 4 or 8 and group >= 1, got bits={bits}, group={group}")
    return quantize_int8(values, group) if bits == 8 else quantize_int4(values, group)


def quantization_error(reference: torch.Tensor, weight: QuantizedWeight) -> tuple[float, float]:
    """(largest absolute error, RMS error / RMS of the reference) of `weight` against the values it stands for."""
    ref = reference.to(torch.float32)
    diff = weight.dequantize() - ref
    if diff.numel() == 0:
        return 0.0, 0.0
    rms_ref = float(ref.square().mean().sqrt())
    rms = float(diff.square().mean().sqrt())
    return float(diff.abs().max()), (rms / rms_ref if rms_ref > 0 else 0.0)

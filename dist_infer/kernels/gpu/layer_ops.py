"""A decoder layer's small ops, each one Triton kernel instead of several torch ones.

- `rms_norm`: HF's RMSNorm (normalise in fp32, scale in the input dtype), with the residual add
  before it in the same pass where one is given: six to eight kernels become one.
- `rope_cache_write`: rotary on the step's queries (in place) and keys, and the keys and values
  written to their cache slots: the torch path's casts, `cat`, `neg`, products and two
  `index_copy_` become one kernel, and no rotated key is written anywhere but the cache.
- `silu_mul`: silu(gate) * up from the fused gate/up product's two halves.

Rounding follows torch's elementwise ops in a 16-bit dtype (each product and sum computed in
fp32 and rounded to the dtype), so the rotary matches HF's bit for bit; the norm's sum of
squares is reduced in another order than torch's (within fp32 rounding).
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None


def _pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


if triton is not None:

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """x (fp32) rounded to `dtype` and back: what a torch op in that dtype stores. By the bits
        (to nearest, ties to even): on the GPU a cast there and back was folded away, leaving the
        rotary's products unrounded, one step off torch's now and then (bf16 and fp16 alike). fp16
        values below its normal range (2**-14) take the cast (the mantissa rule does not hold there)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return bits.to(tl.float32, bitcast=True)
        elif dtype == tl.float16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0xFFF + ((bits >> 13) & 1)) >> 13) << 13
            return tl.where(tl.abs(x) < 6.103515625e-05, x.to(dtype).to(tl.float32), bits.to(tl.float32, bitcast=True))
        else:
            return x

    @triton.jit
    def _rms_norm(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        x_out_ptr,
        n,
        eps,
        stride_x,
        stride_r,
        stride_o,
        stride_xo,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        ok = i < n
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + i, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            x = _round(x + tl.load(res_ptr + row * stride_r + i, mask=ok, other=0.0).to(tl.float32), dtype)
            tl.store(x_out_ptr + row * stride_xo + i, x.to(dtype), mask=ok)
        inv = tl.math.rsqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + i, _round(_round(x * inv, dtype) * w, dtype).to(dtype), mask=ok)

    @triton.jit
    def _rotate(src, dst, ok, c1, c2, s1, s2, HALF: tl.constexpr, dtype: tl.constexpr):
        """Heads at `src` ([heads, half] pointers to each head's first half) rotated to `dst`, as HF's
        x * cos + rotate_half(x) * sin with each product and the sum rounded to `dtype`."""
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        y1 = _round(_round(x1 * c1[None, :], dtype) + _round(-x2 * s1[None, :], dtype), dtype)
        y2 = _round(_round(x2 * c2[None, :], dtype) + _round(x1 * s2[None, :], dtype), dtype)
        tl.store(dst, y1.to(dtype), mask=ok)
        tl.store(dst + HALF, y2.to(dtype), mask=ok)

    @triton.jit
    def _rope_cache_write(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slots_ptr,
        stride_q,
        stride_k,
        stride_v,
        stride_cs,
        stride_slot,
        stride_kc,
        stride_vc,
        Q_HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        QH_PAD: tl.constexpr,
        KVH_PAD: tl.constexpr,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        HAS_Q: tl.constexpr,
    ):
        t = tl.program_id(0)
        j = tl.arange(0, HALF_PAD)
        j_ok = j < HALF
        dtype = k_cache_ptr.dtype.element_ty
        c1 = _round(tl.load(cos_ptr + t * stride_cs + j, mask=j_ok, other=0.0), dtype)
        c2 = _round(tl.load(cos_ptr + t * stride_cs + HALF + j, mask=j_ok, other=0.0), dtype)
        s1 = _round(tl.load(sin_ptr + t * stride_cs + j, mask=j_ok, other=0.0), dtype)
        s2 = _round(tl.load(sin_ptr + t * stride_cs + HALF + j, mask=j_ok, other=0.0), dtype)
        if HAS_Q:
            h = tl.arange(0, QH_PAD)
            at = q_ptr + t * stride_q + h[:, None] * (2 * HALF) + j[None, :]
            _rotate(at, at, (h < Q_HEADS)[:, None] & j_ok[None, :], c1, c2, s1, s2, HALF, dtype)
        slot = tl.load(slots_ptr + t * stride_slot)
        h = tl.arange(0, KVH_PAD)
        ok = (h < KV_HEADS)[:, None] & j_ok[None, :]
        _rotate(
            k_ptr + t * stride_k + h[:, None] * (2 * HALF) + j[None, :],
            k_cache_ptr + slot * stride_kc + h[:, None] * (2 * HALF) + j[None, :],
            ok,
            c1,
            c2,
            s1,
            s2,
            HALF,
            dtype,
        )
        src = v_ptr + t * stride_v + h[:, None] * (2 * HALF) + j[None, :]
        dst = v_cache_ptr + slot * stride_vc + h[:, None] * (2 * HALF) + j[None, :]
        tl.store(dst, tl.load(src, mask=ok, other=0.0), mask=ok)
        tl.store(dst + HALF, tl.load(src + HALF, mask=ok, other=0.0), mask=ok)

    @triton.jit
    def _silu_mul(gate_ptr, up_ptr, out_ptr, n, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        dtype = out_ptr.dtype.element_ty
        g = tl.load(gate_ptr + row * stride_g + i, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * stride_u + i, mask=ok, other=0.0).to(tl.float32)
        act = _round(g / (1.0 + tl.exp(-g)), dtype)
        tl.store(out_ptr + row * stride_o + i, _round(act * u, dtype).to(dtype), mask=ok)


def _rows(t: torch.Tensor) -> bool:
    """A 2-D tensor whose rows are contiguous (a column slice of a wider one is fine)."""
    return t.dim() == 2 and t.stride(1) == 1


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (x + residual, norm(x + residual) * weight); without `residual`, (x, norm(x) * weight)."""
    T, n = x.shape
    out = torch.empty(T, n, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else x
    if T:
        res = residual if residual is not None else x
        _rms_norm[(T,)](
            x,
            res,
            weight,
            out,
            summed,
            n,
            eps,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            summed.stride(0),
            HAS_RES=residual is not None,
            BLOCK=_pow2(n),
            num_warps=4 if n <= 2048 else 8,
        )
    return summed, out


def rope_cache_write(
    q: Optional[torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    q_heads: int,
) -> None:
    """Rotate q [T, q_heads * d] in place (None: no queries) and write rotated k and v [T, kv_heads * d]
    to cache slots `slots` [T] of caches [num_blocks, block_size, kv_heads, d]; cos/sin [T, d] fp32."""
    T = k.shape[0]
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    if not T:
        return
    half = dim // 2
    for t in (k, v) + ((q,) if q is not None else ()):
        assert _rows(t), "rope_cache_write: rows must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    qq = q if q is not None else k
    _rope_cache_write[(T,)](
        qq,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slots,
        qq.stride(0),
        k.stride(0),
        v.stride(0),
        cos.stride(0),
        slots.stride(0),
        k_cache.stride(1),
        v_cache.stride(1),
        Q_HEADS=q_heads,
        KV_HEADS=kv_heads,
        QH_PAD=_pow2(q_heads),
        KVH_PAD=_pow2(kv_heads),
        HALF=half,
        HALF_PAD=_pow2(half),
        HAS_Q=q is not None,
    )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, [T, n] each (the gate/up product's two column halves) -> [T, n]."""
    T, n = gate.shape
    out = torch.empty(T, n, dtype=gate.dtype, device=gate.device)
    if T:
        block = min(1024, _pow2(n))
        _silu_mul[(T, triton.cdiv(n, block))](
            gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0), BLOCK=block
        )
    return out

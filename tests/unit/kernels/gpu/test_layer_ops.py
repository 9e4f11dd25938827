"""The layer's fused Triton kernels (kernels/gpu/layer_ops.py) in Triton's interpreter against torch's
own ops: bit for bit where they round as torch does (rotary and the cache write in fp16 and bf16,
the residual add; SiLU-and-multiply in fp16), within fp32 rounding where the reduction order differs
(RMSNorm's sum of squares)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is not installed (the dev extra installs it)")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="CPU tensors need Triton's interpreter (tests/conftest.py sets it where no GPU is seen)",
)

from dist_infer.kernels.gpu import layer_ops  # noqa: E402
from dist_infer.models.rope import apply_rotary  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_cache_write_as_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    T, heads, kv_heads, dim = 5, 6, 2, 32
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)  # column slices, as qkv_proj gives
    cos, sin = torch.randn(T, dim, generator=gen), torch.randn(T, dim, generator=gen)
    slots = torch.tensor([0, 17, 18, 40, 63])
    k_cache = torch.zeros(4, 16, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    want_q = apply_rotary(q.reshape(T, heads, dim).clone(), cos, sin)
    want_k = apply_rotary(k.reshape(T, kv_heads, dim), cos, sin)
    layer_ops.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, slots, heads)
    exact = dtype != torch.float32  # fp32: the kernel may fuse a product into the sum (one rounding fewer)
    check = torch.equal if exact else lambda a, b: torch.allclose(a, b, atol=1e-6)
    assert check(q.reshape(T, heads, dim), want_q)
    assert check(k_cache.view(-1, kv_heads, dim)[slots], want_k)
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], v.reshape(T, kv_heads, dim))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(64, -1)[untouched].any()  # nothing written anywhere else


def test_rotary_of_keys_alone():
    """q None: the keys and values only (a last layer that rotates its kept queries separately)."""
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 3, 2 * 16, generator=gen)
    cos, sin = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
    caches = torch.zeros(2, 1, 8, 2, 16)
    layer_ops.rope_cache_write(None, k, v, cos, sin, caches[0], caches[1], torch.tensor([1, 2, 7]), 0)
    torch.testing.assert_close(caches[0].view(8, 2, 16)[[1, 2, 7]], apply_rotary(k.view(3, 2, 16), cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual(dtype):
    gen = torch.Generator().manual_seed(2)
    x, res = torch.randn(2, 4, 300, generator=gen).to(dtype)
    w = torch.randn(300, generator=gen).to(dtype)
    summed, normed = layer_ops.rms_norm(x, w, 1e-6, res)
    assert torch.equal(summed, x + res)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(
        normed, w * F.rms_norm((x + res).float(), (300,), eps=1e-6).to(dtype), atol=tol, rtol=tol
    )
    same, normed = layer_ops.rms_norm(x, w, 1e-6)
    assert same is x
    torch.testing.assert_close(normed, w * F.rms_norm(x.float(), (300,), eps=1e-6).to(dtype), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(3, 2 * 1500, generator=gen).to(dtype)
    gate, up = gate_up.split([1500, 1500], -1)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(layer_ops.silu_mul(gate, up), F.silu(gate) * up, atol=tol, rtol=tol)


def test_empty_steps_launch_nothing():
    empty = torch.zeros(0, 64)
    assert layer_ops.silu_mul(empty, empty).shape == (0, 64)
    assert layer_ops.rms_norm(empty, torch.ones(64), 1e-5)[1].shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sums_round_as_torch_across_the_range(dtype):
    """The kernels' rounding by the bits (kernels/gpu/layer_ops.py `_round`) against torch's own, from
    fp16's subnormals to its largest finite values and past them (inf)."""
    gen = torch.Generator().manual_seed(4)
    scale = torch.logspace(-8, 4.9, 1024)
    x = (torch.randn(1024, generator=gen) * scale).to(dtype)
    r = (torch.randn(1024, generator=gen) * scale).to(dtype)
    summed, _ = layer_ops.rms_norm(x[None], torch.ones(1024, dtype=dtype), 1e-5, r[None])
    torch.testing.assert_close(summed[0], x + r, atol=0, rtol=0, equal_nan=True)  # inf + -inf: NaN in both

"""The native CPU kernels against torch, no processes started.

Each kernel is checked on the shapes the models give it (strided QKV slices, GQA and MQA,
several blocks per sequence, a sliding window, K not a multiple of the vector width), and the
whole decode path with the kernels is checked against the torch path it replaces. The end-to-end
exactness against HF runs with the kernels on (the default) in tests/integration/; there,
test_exact_vs_hf.py's test_torch_ops_path_matches_hf runs one model with them off, so both paths
stay exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from dist_infer.engine.api import load
from dist_infer.kernels import MAX_ROWS, kernels_if_cpu_fp32, load_cpu_kernels, use_native_kernels
from dist_infer.models.attention import attention_native, last_token_attention_native, paged_attention
from dist_infer.models.attention_metadata import build_attention_metadata
from dist_infer.models.rope import Rotary, apply_rotary
from dist_infer.parallel.linear import skinny_linear
from tests.support.checkpoints import hf_reference, write_hf_checkpoint
from tests.support.hf_compare import assert_outputs_match_hf, prompts_for

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler: the native kernels are not built")


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("n,k", [(640, 768), (33, 100), (7, 5)])
def test_skinny_linear_matches_torch(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    ref = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(kernels.skinny_linear(x, w), ref, rtol=1e-5, atol=1e-4)


def test_skinny_linear_threads_split_rows_of_w():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x, w = torch.randn(4, 256), torch.randn(1000, 256)
        torch.testing.assert_close(kernels.skinny_linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_skinny_linear_layer_entry_point_adds_bias_and_falls_back_beyond_max_rows():
    w, b = torch.randn(16, 8), torch.randn(16)
    for rows in (1, 3, MAX_ROWS + 1, 40):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(skinny_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_many_rows_go_through_the_kernels_gemm_with_the_kernels_and_torch_without(monkeypatch):
    w, b = torch.randn(24, 40), torch.randn(24)
    x = torch.randn(MAX_ROWS + 5, 40)
    calls = []
    if kernels.gemm is not None:
        real = kernels.gemm

        class Spy:
            def linear(self, *a):
                calls.append(a[0].shape[0])
                return real.linear(*a)

        monkeypatch.setattr(kernels, "gemm", Spy())
    torch.testing.assert_close(skinny_linear(x, w, b, kernels), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert calls == ([MAX_ROWS + 5] if kernels.gemm is not None else [])
    torch.testing.assert_close(skinny_linear(x, w, b, None), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert len(calls) <= 1  # without the kernels: torch's


def test_rms_norm_matches_hf_formula_and_fuses_the_residual():
    x, r, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)

    def ref(v):
        return w * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6))

    torch.testing.assert_close(kernels.rms_norm(x.clone(), w, 1e-6), ref(x))
    summed = x.clone()
    torch.testing.assert_close(kernels.rms_norm(summed, w, 1e-6, residual=r), ref(x + r))
    torch.testing.assert_close(summed, x + r)  # the sum is left in x: the next residual


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (4, 1), (2, 2)])
def test_rope_cache_write_on_strided_qkv_slices(q_heads, kv_heads):
    T, d = 3, 16
    qkv = torch.randn(T, (q_heads + 2 * kv_heads) * d)
    q, k, v = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    cos, sin = Rotary(d, 64, 10000.0).cos_sin(torch.tensor([5, 9, 2]))
    q_ref = apply_rotary(q.reshape(T, q_heads, d), cos, sin).reshape(T, -1)
    k_ref = apply_rotary(k.reshape(T, kv_heads, d), cos, sin)
    v_ref = v.reshape(T, kv_heads, d).clone()
    k_cache, v_cache = torch.zeros(8, 4, kv_heads, d), torch.zeros(8, 4, kv_heads, d)
    slots = torch.tensor([3, 17, 30])
    kernels.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k.reshape(T, kv_heads, d), k_ref)  # rotated in place too
    torch.testing.assert_close(k_cache.view(-1, kv_heads, d)[slots], k_ref)
    torch.testing.assert_close(v_cache.view(-1, kv_heads, d)[slots], v_ref)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(32, -1)[untouched].any() and not v_cache.view(32, -1)[untouched].any()


@pytest.mark.parametrize("q_heads,kv_heads,window", [(4, 2, None), (4, 1, None), (3, 3, None), (4, 2, 5)])
def test_decode_step_matches_the_torch_path(q_heads, kv_heads, window):
    """Rotary + cache write + attention of a decode step, native against torch, over several blocks."""
    d, bs = 16, 4
    lens = [5, 11, 1]  # a sequence fresh from a one-token prompt among cached ones
    tables = [[6, 1], [2, 7, 4], [5]]
    meta = build_attention_metadata([1, 1, 1], lens, tables, bs, sliding_window=window)
    cos, sin = Rotary(d, 64, 10000.0).cos_sin(meta.positions)
    k_cache, v_cache = torch.randn(8, bs, kv_heads, d), torch.randn(8, bs, kv_heads, d)
    qkv = torch.randn(3, (q_heads + 2 * kv_heads) * d)

    def split(t):
        return t.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)

    q, k, v = split(qkv.clone())
    caches = k_cache.clone(), v_cache.clone()
    ref = paged_attention(
        apply_rotary(q.reshape(3, q_heads, d), cos, sin),
        apply_rotary(k.reshape(3, kv_heads, d), cos, sin),
        v.reshape(3, kv_heads, d),
        *caches,
        meta,
        0.3,
    )
    q, k, v = split(qkv.clone())
    native_caches = k_cache.clone(), v_cache.clone()
    out = attention_native(q, k, v, cos, sin, *native_caches, meta, 0.3, kernels)
    assert out is not None, "a CPU fp32 decode step should take the native path"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_caches[0], caches[0])
    torch.testing.assert_close(native_caches[1], caches[1])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "q_heads,kv_heads,d,window", [(8, 4, 32, None), (20, 2, 24, None), (3, 3, 64, 700), (9, 3, 7, None)]
)
def test_decode_attention_over_many_chunks_matches_float64(q_heads, kv_heads, d, window, threads):
    """Long contexts split in chunks (256 keys) over the threads, merged by LSE: the output and
    the LSE against float64 softmax attention, with lengths that end mid-block and mid-chunk, a
    sequence of one key beside long ones, 10 query heads per KV head (two groups of at most 8),
    head sizes off the vector width, a sliding window whose start is mid-chunk."""
    bs, lens = 16, [1000, 1, 257, 513]
    width = max(lens) // bs + 1
    gen = torch.Generator().manual_seed(q_heads * 100 + d)
    blocks = torch.randperm(len(lens) * width, generator=gen).view(len(lens), width)  # scattered blocks
    k_cache = torch.randn(len(lens) * width, bs, kv_heads, d, generator=gen)
    v_cache = torch.randn(len(lens) * width, bs, kv_heads, d, generator=gen)
    q = torch.randn(len(lens), q_heads * d, generator=gen) * 2  # peaked softmaxes as well as flat ones
    lse = torch.empty(len(lens), q_heads)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = kernels.decode_attention(q, k_cache, v_cache, blocks, torch.tensor(lens), window, d**-0.5, lse)
    finally:
        torch.set_num_threads(before)
    for b, n in enumerate(lens):
        start = n - window if window and n > window else 0
        keys = k_cache[blocks[b]].reshape(-1, kv_heads, d)[start:n].double().repeat_interleave(q_heads // kv_heads, 1)
        vals = v_cache[blocks[b]].reshape(-1, kv_heads, d)[start:n].double().repeat_interleave(q_heads // kv_heads, 1)
        scores = torch.einsum("hd,khd->hk", q[b].view(q_heads, d).double(), keys) * d**-0.5
        ref = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), vals)
        torch.testing.assert_close(out[b].view(q_heads, d), ref.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[b], torch.logsumexp(scores, -1).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lens,seq_lens", [([3, 5], [3, 5]), ([2, 1], [6, 4])])
def test_prefill_rotary_in_place_then_sdpa_matches_the_torch_path(q_lens, seq_lens):
    """Prefill (fresh prompts, and new tokens on top of cached context): native rotary and cache
    write, then torch's SDPA on the rotated slices; the last-token variant of the model's last
    layer gives those rows of it."""
    q_heads, kv_heads, d, bs = 4, 2, 16, 4
    tables = [[0, 1], [2, 3]]
    meta = build_attention_metadata(q_lens, seq_lens, tables, bs)
    T = sum(q_lens)
    cos, sin = Rotary(d, 64, 10000.0).cos_sin(meta.positions)
    k_cache, v_cache = torch.randn(4, bs, kv_heads, d), torch.randn(4, bs, kv_heads, d)
    qkv = torch.randn(T, (q_heads + 2 * kv_heads) * d)

    def split(t):
        return t.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)

    q, k, v = split(qkv.clone())
    caches = k_cache.clone(), v_cache.clone()
    ref = paged_attention(
        apply_rotary(q.reshape(T, q_heads, d), cos, sin),
        apply_rotary(k.reshape(T, kv_heads, d), cos, sin),
        v.reshape(T, kv_heads, d),
        *caches,
        meta,
        0.3,
    )
    q, k, v = split(qkv.clone())
    native_caches = k_cache.clone(), v_cache.clone()
    out = attention_native(q, k, v, cos, sin, *native_caches, meta, 0.3, kernels)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_caches[0], caches[0])
    torch.testing.assert_close(native_caches[1], caches[1])

    q, k, v = split(qkv.clone())
    last_caches = k_cache.clone(), v_cache.clone()
    q_last = q[meta.last_token_index].contiguous()
    out_last = last_token_attention_native(q_last, k, v, cos, sin, *last_caches, meta, 0.3, kernels)
    torch.testing.assert_close(out_last, ref[meta.last_token_index], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last_caches[0], caches[0])
    torch.testing.assert_close(last_caches[1], caches[1])


def test_non_fp32_and_context_parallel_keep_the_torch_path():
    decode = build_attention_metadata([1], [3], [[0]], 4)
    q = torch.randn(1, 32)
    caches = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    cos, sin = Rotary(16, 8, 10000.0).cos_sin(decode.positions)
    half = [t.to(torch.bfloat16) for t in (q, q[:, :16], q[:, 16:])]
    assert attention_native(*half, cos, sin, *[c.bfloat16() for c in caches], decode, 1.0, kernels) is None
    decode.cp = object()  # sharded over cp ranks: cp_attention's business
    assert attention_native(q, q[:, :16], q[:, 16:], cos, sin, *caches, decode, 1.0, kernels) is None


def test_kernels_are_an_explicit_switch():
    """Nothing reads an environment variable: a layer uses the kernels it was handed, and None
    (or a tensor they are not written for) means torch's ops."""
    from dist_infer.models.rms_norm import RMSNorm

    norm = RMSNorm(8, 1e-6, torch.float32)
    holder = torch.nn.Sequential(norm)
    assert norm.kernels is None
    use_native_kernels(holder, kernels)
    assert norm.kernels is kernels
    x = torch.randn(3, 8)
    assert kernels_if_cpu_fp32(kernels, x) is kernels
    assert kernels_if_cpu_fp32(kernels, x.bfloat16()) is None and kernels_if_cpu_fp32(None, x) is None
    on = norm(x)
    use_native_kernels(holder, None)
    assert norm.kernels is None
    torch.testing.assert_close(norm(x), on)


def test_native_kernels_switch_in_process(world_groups, tmp_path):
    """The kernels are handed to the layers (`use_native_kernels`), so the same loaded model runs
    with them (the profiler names each call) and, switched off in the same process, without them
    (torch's ops only); both give HF's tokens and logits."""
    path = write_hf_checkpoint(tmp_path, "llama-gqa")
    prompts = prompts_for((5, 17), seed=99)
    ids, logits = hf_reference(path, prompts, 4)
    model = load(path, groups=world_groups)

    def run_profiled():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = model.generate(prompts, max_new_tokens=4, return_logits=True)
        return out, {e.key for e in prof.key_averages()}

    on, names_on = run_profiled()
    use_native_kernels(model.engine.stage, None)
    off, names_off = run_profiled()
    assert "dist_infer::decode_stack" in names_on  # every step's layers in one native call (fused_decode.py)
    assert not any(n.startswith("dist_infer::") and "linear" in n for n in names_off), sorted(names_off)[:20]
    assert_outputs_match_hf(on, prompts, ids, logits, "kernels on")
    assert_outputs_match_hf(off, prompts, ids, logits, "kernels off")

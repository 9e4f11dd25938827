"""The GPU decode step on a real device: the Triton kernels in the dtypes the CPU interpreter cannot
hold faithfully (bf16), and captured CUDA graphs against the eager step and transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf, prompts_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 70])
def test_paged_decode_attention_matches_the_reference(dtype, window):
    from dist_infer.kernels.gpu.paged_decode import paged_decode_attention, paged_decode_attention_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, heads, kv_heads, dim, bs, blocks = 5, 32, 8, 64, 16, 160
    k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(blocks, bs, kv_heads, dim, device="cuda", generator=gen).to(dtype)
    q = torch.randn(B, heads, dim, device="cuda", generator=gen).to(dtype)
    tables = torch.randperm(blocks, device="cuda", generator=gen)[: B * 30].view(B, 30)
    lens = torch.tensor([1, 17, 256, 257, 30 * bs], device="cuda")
    out = paged_decode_attention(q, k, v, tables, lens, dim**-0.5, window)
    ref = paged_decode_attention_reference(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), lens.cpu(), dim**-0.5, window)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_kernels_round_as_torch_does(dtype):
    """Rotary with the cache write, RMSNorm with the residual and SiLU-and-multiply against torch's ops."""
    from dist_infer.kernels.gpu import layer_ops
    from dist_infer.models.rope import apply_rotary

    gen = torch.Generator(device="cuda").manual_seed(1)
    T, heads, kv_heads, dim = 7, 32, 8, 64
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, device="cuda", generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    cos, sin = torch.randn(T, dim, device="cuda", generator=gen), torch.randn(T, dim, device="cuda", generator=gen)
    slots = torch.tensor([3, 40, 41, 90, 100, 7, 250], device="cuda")
    k_cache = torch.zeros(16, 16, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    want_q = apply_rotary(q.reshape(T, heads, dim).clone(), cos, sin)
    want_k = apply_rotary(k.reshape(T, kv_heads, dim), cos, sin)
    layer_ops.rope_cache_write(q, k, v, cos, sin, k_cache, v_cache, slots, heads)
    assert torch.equal(q.reshape(T, heads, dim), want_q)
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[slots], want_k)
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], v.reshape(T, kv_heads, dim))
    x, res = torch.randn(2, T, 2048, device="cuda", generator=gen).to(dtype)
    w = torch.randn(2048, device="cuda", generator=gen).to(dtype)
    summed, normed = layer_ops.rms_norm(x, w, 1e-5, res)
    assert torch.equal(summed, x + res)
    torch.testing.assert_close(
        normed, w * F.rms_norm((x + res).float(), (2048,), eps=1e-5).to(dtype), atol=1e-2, rtol=1e-2
    )
    gate, up = torch.randn(2, T, 5632, device="cuda", generator=gen).to(dtype)
    torch.testing.assert_close(layer_ops.silu_mul(gate, up), F.silu(gate) * up, atol=1e-2, rtol=1e-2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("graphs"), "llama-gqa")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("graphs-window"), "mistral")


def _load(path, **options):
    """A model on this process's GPU in a world of its own (an earlier test's world is closed first)."""
    import torch.distributed as dist

    import dist_infer

    if dist.is_initialized():
        dist.destroy_process_group()
    return dist_infer.load(path, device="cuda", backend="nccl", **options)


def _generate(model, prompts, graphs: str, new_tokens: int):
    from dist_infer.engine.engine_core import Engine, EngineConfig, WorkerOptions
    from dist_infer.engine.sampling import SamplingParams

    engine = Engine(
        model.engine.stage, model.engine.groups, EngineConfig(block_size=16, worker=WorkerOptions(cuda_graphs=graphs))
    )
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    return engine, [o.token_ids for o in outs]


def test_graphs_give_the_eager_steps_ids_and_hfs(llama, mistral, deterministic):
    """fp32: captured steps (batches 1, 3 in bucket 4, 8) equal the eager steps and transformers."""
    for path in (llama, mistral):
        model = _load(path)
        for lengths in ([9], [5, 17, 33], [3, 5, 8, 13, 21, 34, 40, 41]):
            prompts = prompts_for(lengths)
            engine, graphed = _generate(model, prompts, "on", 12)
            assert engine.worker.graphs is not None and engine.worker.graphs.buckets[1].graph is not None
            _, eager = _generate(model, prompts, "off", 12)
            assert graphed == eager, f"{path.name} batch {len(prompts)}: graphs and eager steps differ"
            assert_ids_match_hf(path, prompts, graphed, 12, f"{path.name} CUDA graphs")


@pytest.fixture
def deterministic():
    """torch's deterministic algorithms (cuBLAS's workspace mode is set in conftest.py)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def test_graphs_in_bf16_equal_the_eager_steps(llama, deterministic):
    """bf16: batches that fill their bucket (the same GEMM shapes) give the eager steps' ids exactly."""
    model = _load(llama, dtype=torch.bfloat16)
    for lengths in ([9], [5, 17, 33, 12]):
        prompts = prompts_for(lengths)
        _, graphed = _generate(model, prompts, "on", 24)
        _, eager = _generate(model, prompts, "off", 24)
        assert graphed == eager


def test_speculative_steps_on_the_gpu_give_plain_decodings_tokens(llama, deterministic):
    """--speculative ngram on CUDA (graphs on: decode-only steps graphed, verifying steps eager):
    greedy and seeded sampling give the plain run's ids, proposals were made, and the verified rows'
    sampling runs on the device (its generators are CUDA ones)."""
    from dist_infer.engine.engine_core import Engine, EngineConfig, WorkerOptions
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.engine.speculative.config import SpeculativeConfig

    model = _load(llama)
    phrase = [11, 42, 7, 93, 28]
    prompts = [[5] + phrase * 3 + phrase[:2], [8, 9] + phrase * 2, prompts_for([13])[0]]
    for params in (
        SamplingParams(max_new_tokens=24),
        SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=5, stop_at_eos=False),
    ):
        runs = []
        for spec in (None, SpeculativeConfig(ngram_min=1)):
            config = EngineConfig(block_size=16, worker=WorkerOptions(cuda_graphs="on"), speculative=spec)
            engine = Engine(model.engine.stage, model.engine.groups, config)
            runs.append([o.token_ids for o in engine.generate(prompts, params)])
        assert runs[0] == runs[1]
        assert engine.speculative.snapshot()["num_draft_tokens"] > 0

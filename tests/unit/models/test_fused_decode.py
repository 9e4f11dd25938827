"""A step in one native call (models/fused_decode.py, kernels/decode_stack.c): decode steps, and
prefills and mixed steps (prompt chunks beside decodes, through BLAS) against the layer-by-layer
path on the same stage (within fp32 rounding, the same ids) and against transformers (greedy ids
identical, logits within fp32 tolerance), fp32 and quantized; the cases it leaves to the
layer-by-layer path; and the kernel's refusal of shapes it cannot take."""

from __future__ import annotations

import pytest
import torch

from dist_infer.engine.engine_core import Engine, EngineConfig
from dist_infer.engine.sampling import SamplingParams
from dist_infer.kernels import load_cpu_kernels
from dist_infer.kernels.gemm import blas_sgemm, onednn_sgemm
from dist_infer.models.loader import stage_from_hf_model
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.quantized_reference import dequantize_hf_model
from tests.support.threads import run_ranks, thread_groups

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the native kernels are not built")

PROMPTS = [[5, 9, 17, 3, 44], [7, 11] * 6, [2] * 19]  # three lengths: a decode step of 3 rows, 3 contexts
NEW = 6


def _generate(stage, group, prompts, fused: bool, **config):
    stage.native_decode_stack = fused
    stage.decode_stack_cache = None
    outs = Engine(stage, group, EngineConfig(**config)).generate(
        prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False), return_logits=True
    )
    return [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


def _fused_ran(stage) -> bool:
    cached = stage.decode_stack_cache
    return cached is not None and cached.plan is not None


def _assert_agrees(on, off, reference) -> None:
    """The native step's (ids, logits) equal the layer path's (within fp32 rounding) and transformers'
    (the same ids, logits within fp32 tolerance)."""
    assert on[0] == off[0] == reference[0]
    for got, layer, want in zip(on[1], off[1], reference[1]):
        torch.testing.assert_close(got, layer, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "arch,scheme", [("llama-gqa", "none"), ("llama-mqa", "int4"), ("llama-tied", "int8"), ("llama31-rope", "int4")]
)
def test_fused_decode_equals_layer_by_layer_and_transformers(arch, scheme, tmp_path):
    hf = load_hf_model(write_hf_checkpoint(tmp_path, arch))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, quantization=scheme, native_kernels=True)
    off = _generate(stage, group, PROMPTS, fused=False)
    assert not _fused_ran(stage)
    on = _generate(stage, group, PROMPTS, fused=True)
    assert _fused_ran(stage)
    model = hf if scheme == "none" else dequantize_hf_model(hf, scheme, 1)
    _assert_agrees(on, off, hf_reference(None, PROMPTS, NEW, model=model))


def test_fused_decode_with_a_sliding_window_equals_layer_by_layer(tmp_path):
    """Mistral with a window shorter than the prompts: the attention sees the last `window` keys."""
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "mistral", sliding_window=8))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, native_kernels=True)
    ids_off, logits_off = _generate(stage, group, PROMPTS, fused=False)
    ids_on, logits_on = _generate(stage, group, PROMPTS, fused=True)
    assert _fused_ran(stage) and ids_on == ids_off
    for a, b in zip(logits_on, logits_off):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "mixtral"])  # a QKV bias; experts instead of a dense MLP
def test_layers_it_does_not_serve_go_layer_by_layer(arch, tmp_path):
    hf = load_hf_model(write_hf_checkpoint(tmp_path, arch))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, native_kernels=True)
    ids, _ = _generate(stage, group, PROMPTS[:1], fused=True)
    assert not _fused_ran(stage)  # refused (qwen2: looked at once and cached; MoE stages never ask)
    assert ids == hf_reference(None, PROMPTS[:1], NEW, model=hf)[0]


UNEVEN_HEADS = dict(hidden_size=288, num_attention_heads=9, num_key_value_heads=3)  # the default model's 9 / 3


@pytest.mark.parametrize("shape,scheme", [(UNEVEN_HEADS, "none"), ({}, "int4")])
def test_tensor_parallel_stages_run_each_layer_in_two_halves(shape, scheme, tmp_path):
    """tp=2, each layer's attention and MLP halves a native call each with the all-reduces between
    them: the default model's uneven heads (6 + 3 / 2 + 1 KV per rank) in fp32, and int4 (whose
    reference, dequantize_hf_model, quantizes even column shards)."""
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-gqa", **shape))

    def body(g):
        stage = stage_from_hf_model(hf, g, quantization=scheme, native_kernels=True)
        off = _generate(stage, g, PROMPTS, fused=False)
        on = _generate(stage, g, PROMPTS, fused=True)
        return off, on, _fused_ran(stage)

    results = run_ranks(thread_groups(2, 1), body)
    model = hf if scheme == "none" else dequantize_hf_model(hf, scheme, 2)
    reference = hf_reference(None, PROMPTS, NEW, model=model)
    for off, on, ran in results:
        assert ran
        _assert_agrees(on, off, reference)


LONG_PROMPTS = [[(3 * i + 1) % 97 + 2 for i in range(30)], [(5 * i + 2) % 89 + 2 for i in range(21)], [4, 8, 15, 16]]


def _use_gemm(monkeypatch, choice: str) -> None:
    """The stack's products through `choice` (kernels/gemm.py), or a skip where it is not here."""
    gemm = {"onednn": onednn_sgemm, "blas": blas_sgemm}[choice]()
    if gemm is None:
        pytest.skip(f"no {choice} GEMM loads here: steps past MAX_ROWS rows take the other one")
    monkeypatch.setattr(KERNELS, "sgemm", gemm.address)
    monkeypatch.setattr(KERNELS, "sgemm_row_major", gemm.row_major)


@pytest.mark.parametrize("gemm", ["onednn", "blas"])
@pytest.mark.parametrize(
    "arch,scheme,extra",
    [("llama-gqa", "none", {}), ("llama-mqa", "int4", {}), ("mistral", "none", {"sliding_window": 8})],
)
def test_mixed_steps_run_natively_and_equal_layer_by_layer_and_transformers(
    arch, scheme, extra, gemm, tmp_path, monkeypatch
):
    """A budget of 12 tokens a step: prompts cut into chunks that attend to their own earlier
    chunks, beside decodes (a window shorter than the context under Mistral). Steps of more than
    MAX_ROWS rows run in the native stack (the products through oneDNN's GEMM or BLAS's, the
    chunk's attention in two GEMMs)."""
    _use_gemm(monkeypatch, gemm)
    hf = load_hf_model(write_hf_checkpoint(tmp_path, arch, **extra))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, quantization=scheme, native_kernels=True)
    off = _generate(stage, group, LONG_PROMPTS, fused=False, max_batched_tokens=12)
    rows = []
    step = KERNELS.decode_step
    monkeypatch.setattr(
        KERNELS, "decode_step", lambda plan, batch, *a, **k: rows.append(batch) or step(plan, batch, *a, **k)
    )
    on = _generate(stage, group, LONG_PROMPTS, fused=True, max_batched_tokens=12)
    assert max(rows) == 12 and 3 in rows  # chunks (12 rows a step, decodes among them), then 3 decodes
    model = hf if scheme == "none" else dequantize_hf_model(hf, scheme, 1)
    _assert_agrees(on, off, hf_reference(None, LONG_PROMPTS, NEW, model=model))


SPLIT_PROMPTS = [[(3 * i + 1) % 97 + 2 for i in range(650)], [(5 * i + 2) % 89 + 2 for i in range(600)]]


@pytest.mark.parametrize("alone", [True, False])
@pytest.mark.parametrize(
    "arch,scheme,extra",
    [("llama-gqa", "none", {}), ("llama-mqa", "int4", {}), ("mistral", "none", {"sliding_window": 300})],
)
def test_a_few_rows_over_a_long_context_attend_in_chunks_of_keys(arch, scheme, extra, alone, tmp_path):
    """Prompts of 600-650 tokens in chunks of at most 20 rows: past 512 keys each chunk (2..32 rows of
    one sequence) attends through split_attention, the keys split over the threads and each chunk of
    them read once for every row and head. Alone, a prompt's blocks lie one after the other in the
    cache and are read in place; two at a time, their blocks alternate and are copied per chunk. A
    window shorter than the context under Mistral. The same ids and logits as the layer path and
    transformers."""
    hf = load_hf_model(write_hf_checkpoint(tmp_path, arch, max_position_embeddings=1024, **extra))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, quantization=scheme, native_kernels=True)
    prompts = SPLIT_PROMPTS[:1] if alone else SPLIT_PROMPTS
    on = _generate(stage, group, prompts, fused=True, max_batched_tokens=20)
    assert _fused_ran(stage)
    off = _generate(stage, group, prompts, fused=False, max_batched_tokens=20)
    model = hf if scheme == "none" else dequantize_hf_model(hf, scheme, 1)
    _assert_agrees(on, off, hf_reference(None, prompts, NEW, model=model))


def test_a_few_rows_over_a_long_context_attend_in_chunks_of_keys_under_tensor_parallel(tmp_path):
    """tp=2 with the default model's uneven heads (6 + 3 / 2 + 1 KV per rank): each rank's own heads
    of the short chunks over 600-650 tokens through split_attention; the ids and logits of the layer
    path and of transformers."""
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-gqa", max_position_embeddings=1024, **UNEVEN_HEADS))

    def body(g):
        stage = stage_from_hf_model(hf, g, native_kernels=True)
        on = _generate(stage, g, SPLIT_PROMPTS, fused=True, max_batched_tokens=20)
        ran = _fused_ran(stage)
        return _generate(stage, g, SPLIT_PROMPTS, fused=False, max_batched_tokens=20), on, ran

    reference = hf_reference(None, SPLIT_PROMPTS, NEW, model=hf)
    for off, on, ran in run_ranks(thread_groups(2, 1), body):
        assert ran
        _assert_agrees(on, off, reference)


@pytest.mark.parametrize("gemm", ["onednn", "blas"])
@pytest.mark.parametrize("threads", [2, 8])
def test_a_long_prefill_takes_panels_on_few_threads_and_one_product_on_many(threads, gemm, tmp_path, monkeypatch):
    """A 140-token prompt beside a short one: 145 rows, past WHOLE_GEMM_ROWS. On 2 threads the
    int4 weights are dequantized in panels, on 8 whole into one product; both equal the layer path
    and transformers, through either GEMM."""
    _use_gemm(monkeypatch, gemm)
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama31-rope"))  # 256 positions
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, quantization="int4", native_kernels=True)
    prompts = [[(7 * i) % 120 + 3 for i in range(140)], [5, 9, 17, 3, 44]]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ids_off, logits_off = _generate(stage, group, prompts, fused=False)
        ids_on, logits_on = _generate(stage, group, prompts, fused=True)
    finally:
        torch.set_num_threads(before)
    assert _fused_ran(stage) and ids_on == ids_off
    for a, b in zip(logits_on, logits_off):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    ref_ids, ref_logits = hf_reference(None, prompts, NEW, model=dequantize_hf_model(hf, "int4", 1))
    assert ids_on == ref_ids
    for got, want in zip(logits_on, ref_logits):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_the_kernel_refuses_a_batch_it_cannot_take(tmp_path, monkeypatch):
    """Nine rows without BLAS (the skinny kernels take 1..8): a ValueError naming the step, and
    nothing written; with BLAS the same nine decodes equal the layer-by-layer path's."""
    from dist_infer.engine.kv_cache import PagedKVCache
    from dist_infer.models.attention_metadata import build_attention_metadata
    from dist_infer.models.fused_decode import fused_decode

    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-gqa"))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, native_kernels=True)
    caches = PagedKVCache(len(stage.layers), 16, 16, stage.kv_heads_local, stage.cfg.head_dim).layers
    hidden = stage.cfg.hidden_size
    with torch.inference_mode():
        assert (
            fused_decode(stage, torch.randn(1, hidden), build_attention_metadata([1], [3], [[0]], 16), caches)
            is not None
        )  # planned against these caches
        plan, kernels = stage.decode_stack_cache.plan, stage.layers[0].self_attn.kernels
        meta = build_attention_metadata([1] * 9, [3] * 9, [[b] for b in range(9)], 16)
        x = torch.randn(9, hidden)
        cos, sin = stage.rotary.cos_sin(meta.positions)
        k_before = caches[0][0].clone()
        if kernels.sgemm is not None:
            fused = fused_decode(stage, x, meta, caches)
            stage.native_decode_stack = False
            by_layer = stage._forward_layers(x, None, meta, caches, trim=False)
            torch.testing.assert_close(fused, by_layer, atol=1e-5, rtol=1e-5)
            stage.native_decode_stack = True
            caches[0][0].copy_(k_before)
        monkeypatch.setattr(kernels, "sgemm", None)
        with pytest.raises(ValueError, match="decode_step: 9 rows need a BLAS sgemm"):
            kernels.decode_step(plan, 9, cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_lens_t, None, 16)
        step = plan.step(9, cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_lens_t, None, 16, 1)
        with pytest.raises(ValueError, match="decode_stack"):
            kernels.decode_stack(plan, step, x)
        assert torch.equal(caches[0][0], k_before)
        assert fused_decode(stage, x, meta, caches) is None  # over MAX_ROWS without BLAS: layer by layer
        with pytest.raises(ValueError, match="decode_layer_part"):  # a layer the plan has not got
            kernels.decode_layer_part(
                plan,
                kernels.decode_step(
                    plan,
                    1,
                    cos[:1],
                    sin[:1],
                    meta.slot_mapping[:1],
                    meta.block_tables[:1],
                    meta.seq_lens_t[:1],
                    None,
                    16,
                ),
                len(plan.layers),
                0,
                x[:1].clone(),
                None,
                torch.empty(1, hidden),
            )
        with pytest.raises(ValueError, match="runs must be"):
            plan.step(
                9,
                cos,
                sin,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens_t,
                None,
                16,
                1,
                None,
                torch.tensor([0, 5, 4, 9]),
            )


@pytest.mark.parametrize("tp,ladder,span", [(1, "all", (0, 3)), (2, "all", (0, 3)), (2, "1:2", (1, 2))])
def test_a_ladder_stage_runs_its_halves_with_the_ladder_wiring(tp, ladder, span, tmp_path):
    """The ladder's decode steps in C (models/ladder.py's wiring over decode_layer_part): the
    layer-by-layer ladder's logits and ids, and the plain reference of the ladder forward's."""
    from tests.support.ladder_reference import reference_greedy

    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-gqa", num_hidden_layers=4))

    def body(g):
        stage = stage_from_hf_model(hf, g, native_kernels=True, ladder=ladder)
        off = _generate(stage, g, PROMPTS, fused=False)
        on = _generate(stage, g, PROMPTS, fused=True)
        return off, on, _fused_ran(stage)

    for (ids_off, logits_off), (ids_on, logits_on), ran in run_ranks(thread_groups(tp, 1), body):
        assert ran and ids_on == ids_off
        for prompt, ids, got, off in zip(PROMPTS, ids_on, logits_on, logits_off):
            torch.testing.assert_close(got, off, atol=1e-5, rtol=1e-5)
            want_ids, want_logits = reference_greedy(hf, prompt, span, NEW)
            assert ids == want_ids
            torch.testing.assert_close(got, want_logits, atol=2e-4, rtol=1e-4)

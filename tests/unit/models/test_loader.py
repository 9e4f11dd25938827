"""Loading quantized: the scheme resolved from --quantization, and whole models, ranks as threads,
against transformers running the dequantized weights (tp and ep, from an in-memory model or from
the files); tied models hold one quantized table for the embedding and the head (no float table
anywhere) and equal transformers on the dequantized tied table, from HF weights (int8, int4) and
from a GGUF file (auto, whose blocks convert exactly, so HF's own GGUF dequantization is the
reference)."""

from __future__ import annotations

from itertools import chain

import pytest
import torch

from dist_infer.engine.engine_core import Engine
from dist_infer.engine.sampling import SamplingParams
from dist_infer.models.loader import load_stage, resolve_quantization, stage_from_hf_model
from dist_infer.parallel.quantized_linear import GroupQuantLinear, Int4Linear, Int8Linear, QuantizationError
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.gguf_files import write_llama_gguf
from tests.support.quantized_helpers import NATIVE, VOCAB_PROMPTS
from tests.support.quantized_reference import dequantize_hf_model
from tests.support.threads import run_ranks, thread_groups


def test_resolve_quantization():
    assert resolve_quantization("auto", gguf=False, device=None) == "none"
    assert resolve_quantization("auto", gguf=True, device=torch.device("cpu")) == "auto"
    assert resolve_quantization("int4", gguf=False, device=None) == "int4"
    with pytest.raises(QuantizationError, match="CPU only"):
        resolve_quantization("int8", gguf=False, device=torch.device("cuda", 0))
    with pytest.raises(QuantizationError, match="one of"):
        resolve_quantization("fp8", gguf=False, device=None)


# -- whole models, ranks as threads, against transformers on the dequantized weights -----------------


@pytest.mark.parametrize(
    "arch,scheme,tp,ep,native",
    [
        ("llama-gqa", "int8", 2, 1, True),
        ("llama-gqa", "int8", 2, 1, False),
        ("qwen2", "int4", 2, 1, True),
        ("qwen2", "int4", 2, 1, False),
        ("mixtral", "int8", 1, 2, True),
        ("qwen3-moe", "int4", 2, 1, True),
        ("qwen3-moe", "int8", 2, 1, False),
        ("mixtral", "int4", 2, 1, "disk"),
    ],
)
def test_model_over_threads_equals_hf_on_dequantized_weights(arch, scheme, tp, ep, native, tmp_path):
    """native "disk": load_stage from the checkpoint's files (per-expert tensors, lazily sliced),
    the others from transformers' in-memory model (fused experts). Tied models: below."""
    if native and NATIVE is None:
        pytest.skip("no C compiler: the native CPU kernels are not built")

    overrides = {"intermediate_size": 256} if arch == "mixtral" else {}  # 128 per rank: whole int4 groups
    path = write_hf_checkpoint(tmp_path, arch, **overrides)
    hf = load_hf_model(path)
    prompts = [[5, 9, 17, 3, 44], [7, 11] * 6]

    def body(g):
        if native == "disk":
            stage = load_stage(path, g, quantization=scheme)[0]
        else:
            stage = stage_from_hf_model(hf, g, quantization=scheme, native_kernels=native)
        kinds = GroupQuantLinear if native else (Int8Linear, Int4Linear)
        quantized = sum(isinstance(m, kinds) for m in stage.modules())
        params = SamplingParams(max_new_tokens=4, stop_at_eos=False)
        outs = Engine(stage, g).generate(prompts, params, return_logits=True)
        return outs, quantized

    results = run_ranks(thread_groups(tp, ep), body)
    ref_ids, ref_logits = hf_reference(None, prompts, 4, model=dequantize_hf_model(hf, scheme, tp))
    for outputs, quantized in results:
        assert quantized > 0
        for b, out in enumerate(outputs):
            assert out.token_ids == ref_ids[b]
            torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=2e-4, rtol=1e-4)


# -- tied models ------------------------------------------------------------------------------------


def _float_tables(stage) -> list[str]:
    """Floating-point tensors of the embedding and the LM head of `stage` past a quarter of a float
    vocabulary shard (their scales and zeros are a 32nd of it each)."""
    found = []
    for module in (stage.embed_tokens, stage.lm_head):
        size = module.local * module.hidden // 4
        found += [
            f"{module.name}.{n}"
            for n, t in chain(module.named_parameters(), module.named_buffers())
            if t.is_floating_point() and t.numel() >= size
        ]
    return found


@pytest.mark.parametrize("scheme,native", [("int8", True), ("int4", True), ("int8", False), ("int4", False)])
def test_tied_head_and_embedding_hold_one_quantized_table(scheme, native, tmp_path):
    """int8 / int4 on a tied model: the table is quantized once; the head computes with the
    embedding's own module (beside torch's int4 form, the embedding keeps the integers unpacked
    for lookups), and no float table is allocated."""
    if native and NATIVE is None:
        pytest.skip("no C compiler: the native CPU kernels are not built")

    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-tied"))
    stage = stage_from_hf_model(hf, thread_groups(1, 1)[0], quantization=scheme, native_kernels=native)
    embed, head = stage.embed_tokens, stage.lm_head
    assert embed.weight is None and head.weight is None
    if native or scheme == "int8":
        assert head.quantized is embed.quantized
        assert isinstance(head.quantized, GroupQuantLinear if native else Int8Linear)
    else:
        assert isinstance(head.quantized, Int4Linear) and isinstance(embed.quantized, GroupQuantLinear)
    assert _float_tables(stage) == []


@pytest.mark.parametrize("scheme,native", [("int8", True), ("int4", True), ("int8", False), ("int4", False)])
def test_tied_model_over_threads_equals_hf_on_the_dequantized_tied_table(scheme, native, tmp_path):
    """tp=2 (each rank its half of the vocabulary): greedy ids equal, logits within fp32 tolerance of
    transformers with the tied table (both ends) and every linear replaced by its dequantized value."""
    if native and NATIVE is None:
        pytest.skip("no C compiler: the native CPU kernels are not built")

    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-tied"))

    def body(g):
        stage = stage_from_hf_model(hf, g, quantization=scheme, native_kernels=native)
        assert stage.embed_tokens.weight is None and stage.lm_head.quantized is not None
        return Engine(stage, g).generate(
            VOCAB_PROMPTS, SamplingParams(max_new_tokens=4, stop_at_eos=False), return_logits=True
        )

    results = run_ranks(thread_groups(2, 1), body)
    ref_ids, ref_logits = hf_reference(None, VOCAB_PROMPTS, 4, model=dequantize_hf_model(hf, scheme, tp=2))
    for outputs in results:
        for b, out in enumerate(outputs):
            assert out.token_ids == ref_ids[b]
            torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype,native", [("Q8_0", True), ("Q4_1", True), ("Q4_1", False), ("Q8_0", False)])
def test_tied_gguf_auto_keeps_the_files_table_and_equals_hf(qtype, native, tmp_path):
    """--quantization auto on a tied GGUF whose table converts exactly: the embedding and the head
    hold the file's blocks (shared where the head's form can be indexed; Q8_0 without the native
    kernels has no int kernel and is one float table, exact), and tp=2 equals transformers loading
    the same file (it dequantizes to the same fp32 values)."""
    if native and NATIVE is None:
        pytest.skip("no C compiler: the native CPU kernels are not built")

    path = write_llama_gguf(tmp_path / "tied.gguf", qtype=qtype, tied=True, seed=5)

    def body(g):
        stage = load_stage(path, g, quantization="auto", native_kernels=native)[0]
        embed, head = stage.embed_tokens, stage.lm_head
        if qtype == "Q8_0" and not native:
            assert embed.quantized is None and head.weight is embed.weight
        else:
            assert embed.weight is None and head.weight is None and _float_tables(stage) == []
            assert (head.quantized is embed.quantized) == native
        return Engine(stage, g).generate(
            VOCAB_PROMPTS, SamplingParams(max_new_tokens=4, stop_at_eos=False), return_logits=True
        )

    results = run_ranks(thread_groups(2, 1), body)
    ref_ids, ref_logits = hf_reference(path, VOCAB_PROMPTS, 4)
    for outputs in results:
        for b, out in enumerate(outputs):
            assert out.token_ids == ref_ids[b]
            torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=2e-4, rtol=1e-4)

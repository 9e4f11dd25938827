"""bf16 prompts (`--prompt-dtype`, models/fused_decode.py, kernels/decode_stack.c): a prompt's tokens
take their linears' and attention's products in bf16 (oneDNN's bf16 GEMM, fp32 accumulation), the
generated tokens fp32. Checked against transformers with the same products rounded
(tests/support/bf16_reference.py: greedy ids identical, logits within a bf16 rounding flip), against the
fp32 path within the bf16 tolerance the flag's help states, the same however a prompt is chunked or
batched, under tp=2, and the flag's refusals."""

from __future__ import annotations

import pytest
import torch

from dist_infer.engine.engine_core import Engine, EngineConfig
from dist_infer.engine.sampling import SamplingParams
from dist_infer.kernels import load_cpu_kernels
from dist_infer.kernels.gemm import cpu_bf16_instructions
from dist_infer.models import fused_decode
from dist_infer.models.loader import stage_from_hf_model
from tests.support.bf16_reference import bf16_prompt_products
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.quantized_reference import dequantize_hf_model
from tests.support.threads import run_ranks, thread_groups

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(
    KERNELS is None or KERNELS.gemm_bf16 is None or KERNELS.sgemm is None or not cpu_bf16_instructions(),
    reason="no native kernels, no oneDNN bf16 GEMM or no bf16 matrix instructions here",
)

PROMPTS = [[(3 * i + 1) % 97 + 2 for i in range(30)], [(5 * i + 2) % 89 + 2 for i in range(21)], [4, 8, 15, 16]]
NEW = 6
# Against the rounded reference the logits agree to ~1e-6 but where an activation fp32's summation
# order leaves on the other side of a bf16 midpoint: that value rounds one bf16 step (2**-8) apart,
# and moves the logits by up to ~2e-3 (seen once, int8 weights); 5e-3 is still ten times below bf16's
# own distance from fp32
ROUNDING_FLIP = 5e-3
BF16_LOGIT_TOLERANCE = 0.02  # |bf16 - fp32| logits, relative to the largest |logit| (the flag's help: ~1%)


def _generate(stage, group, prompts, bf16: bool, **config):
    stage.prompt_bf16 = bf16
    stage.decode_stack_cache = None
    outs = Engine(stage, group, EngineConfig(**config)).generate(
        prompts, SamplingParams(max_new_tokens=NEW, stop_at_eos=False), return_logits=True
    )
    return [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


def _reference(hf, scheme: str, tp: int = 1):
    model = hf if scheme == "none" else dequantize_hf_model(hf, scheme, tp)
    with bf16_prompt_products(model):
        return hf_reference(None, PROMPTS, NEW, model=model)


def assert_near_fp32(ids, logits, ids32, logits32):
    """bf16's logits within BF16_LOGIT_TOLERANCE of fp32's at every step both took; its ids fp32's,
    or where they part, at a near tie: the fp32 logits of the two tokens closer than the tolerance."""
    for seq, (a, b, la, lb) in enumerate(zip(ids, ids32, logits, logits32)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        scale = float(lb.abs().max())
        gap = (la[: first + 1] - lb[: first + 1]).abs().max()
        assert gap <= BF16_LOGIT_TOLERANCE * scale, f"prompt {seq}: logits {gap:.4f} apart (scale {scale:.2f})"
        if first < len(a):
            tie = abs(float(lb[first, a[first]] - lb[first, b[first]]))
            assert tie <= BF16_LOGIT_TOLERANCE * scale, f"prompt {seq}: step {first} differs with a gap of {tie}"


@pytest.mark.parametrize("arch,scheme", [("llama-gqa", "none"), ("llama-mqa", "int4"), ("llama-tied", "int8")])
def test_bf16_prompts_equal_the_rounded_reference_and_stay_near_fp32(arch, scheme, tmp_path):
    hf = load_hf_model(write_hf_checkpoint(tmp_path, arch))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, quantization=scheme, native_kernels=True)
    ids32, logits32 = _generate(stage, group, PROMPTS, bf16=False)
    ids, logits = _generate(stage, group, PROMPTS, bf16=True)
    ref_ids, ref_logits = _reference(hf, scheme)
    assert ids == ref_ids
    for got, want in zip(logits, ref_logits):
        torch.testing.assert_close(got, want, atol=ROUNDING_FLIP, rtol=0)
    assert_near_fp32(ids, logits, ids32, logits32)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(logits, logits32))  # bf16 did run


@pytest.mark.parametrize("budget", [5, 12])
def test_a_prompt_takes_the_same_products_however_it_is_chunked_or_batched(budget, tmp_path):
    """Each prompt alone in one step, against all three together under a budget of 5 or 12 tokens:
    chunks of 1 to 12 rows (shorter than the kernel's chunked attention takes for fp32 rows), beside
    other prompts' chunks and decodes. The same ids, logits within fp32 rounding."""
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-gqa"))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, quantization="int4", native_kernels=True)
    alone = [_generate(stage, group, [p], bf16=True, max_batched_tokens=64) for p in PROMPTS]
    ids, logits = _generate(stage, group, PROMPTS, bf16=True, max_batched_tokens=budget)
    assert ids == [a[0][0] for a in alone]
    for got, (_, want) in zip(logits, alone):
        torch.testing.assert_close(got, want[0], atol=1e-4, rtol=1e-4)


def test_tensor_parallel_stages_take_bf16_prompts_too(tmp_path):
    """tp=2 (each layer's halves a native call each, the all-reduces between): the rounded
    reference's ids and logits."""
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-gqa"))

    def body(g):
        stage = stage_from_hf_model(hf, g, native_kernels=True)
        return _generate(stage, g, PROMPTS, bf16=True)

    ref_ids, ref_logits = _reference(hf, "none")
    for ids, logits in run_ranks(thread_groups(2, 1), body):
        assert ids == ref_ids
        for got, want in zip(logits, ref_logits):
            torch.testing.assert_close(got, want, atol=ROUNDING_FLIP, rtol=0)


def test_the_flag_resolves_or_says_why_not(tmp_path, monkeypatch):
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-gqa"))
    stage = stage_from_hf_model(hf, thread_groups(1, 1)[0], native_kernels=True)
    assert fused_decode.prompt_bf16("float32", stage) is False
    monkeypatch.setattr(fused_decode, "cpu_bf16_instructions", lambda: ["avx512_bf16"])
    assert fused_decode.prompt_bf16("bfloat16", stage) is True
    assert fused_decode.prompt_bf16("auto", stage) is True
    monkeypatch.setattr(fused_decode, "cpu_bf16_instructions", lambda: [])
    assert fused_decode.prompt_bf16("auto", stage) is False
    with pytest.raises(ValueError, match="--prompt-dtype bfloat16: this CPU has no bf16 matrix instructions"):
        fused_decode.prompt_bf16("bfloat16", stage)
    monkeypatch.setattr(fused_decode, "cpu_bf16_instructions", lambda: ["amx_bf16"])
    stage.native_decode_stack = False
    with pytest.raises(ValueError, match="--native-kernels"):
        fused_decode.prompt_bf16("bfloat16", stage)
    plain = stage_from_hf_model(hf, thread_groups(1, 1)[0], native_kernels=False)
    assert fused_decode.prompt_bf16("auto", plain) is False


def test_an_engine_with_bf16_prompts_caches_no_generated_blocks(tmp_path):
    """Its prefix cache keeps prompt blocks only (SchedulerConfig.cache_generated): a later prompt
    matching a generated block would take keys computed in fp32 where alone it computes bf16 ones."""
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-gqa"))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, native_kernels=True)
    for bf16 in (False, True):
        stage.prompt_bf16 = bf16
        engine = Engine(stage, group, EngineConfig(prefix_caching=True))
        engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2, stop_at_eos=False))
        assert engine.scheduler.config.cache_generated is not bf16


def test_preempted_requests_recompute_their_prompts_in_bf16_and_end_as_alone(tmp_path):
    """A cache too small for all three: requests are preempted and recomputed (their prompts in
    bf16 again, their generated tokens in fp32, as first computed); each ends with its run alone's ids
    and logits (fp32 rounding apart), and every block is free again."""
    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-gqa"))
    group = thread_groups(1, 1)[0]
    stage = stage_from_hf_model(hf, group, native_kernels=True)
    alone = [_generate(stage, group, [p], bf16=True, block_size=4) for p in PROMPTS]
    stage.decode_stack_cache = None
    engine = Engine(stage, group, EngineConfig(block_size=4, num_blocks=12, max_batched_tokens=12, max_num_seqs=3))
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, stop_at_eos=False), return_logits=True)
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for all three"
    assert engine.stats()["free_blocks"] == 12, "KV blocks conserved"
    for out, (ids, logits) in zip(outs, alone):
        assert out.token_ids == ids[0]
        torch.testing.assert_close(torch.stack(out.logits), logits[0], atol=1e-4, rtol=1e-4)

"""The MoE block of a model read from transformers' in-memory modules: their fused expert tensors,
over two ep ranks played by threads (tests/support/threads.py), give HF's tokens and logits."""

from __future__ import annotations

import pytest
import torch

from dist_infer.engine.engine_core import Engine
from dist_infer.engine.sampling import SamplingParams
from dist_infer.models.loader import stage_from_hf_model
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.threads import run_ranks, thread_groups


@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_in_memory_transformers_model_over_two_ep_threads(arch, tmp_path):
    """stage_from_hf_model reads transformers' fused in-memory expert tensors; ep=2 gives HF's logits."""
    hf = load_hf_model(write_hf_checkpoint(tmp_path, arch))
    assert any("experts.gate_up_proj" in n for n, _ in hf.named_parameters()), "expected fused experts in memory"
    prompts = [[5, 9, 17, 3, 44], [7] * 12]
    ref_ids, ref_logits = hf_reference(None, prompts, 4, model=hf)

    def body(g):
        engine = Engine(stage_from_hf_model(hf, g), g)
        return engine.generate(prompts, SamplingParams(max_new_tokens=4, stop_at_eos=False), return_logits=True)

    for outputs in run_ranks(thread_groups(1, 2), body):
        for b, out in enumerate(outputs):
            assert out.token_ids == ref_ids[b]
            torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=1e-4, rtol=1e-4)

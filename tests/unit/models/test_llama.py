"""The Llama layers in one process: a long prefill's MLP in row slices gives HF's tokens and logits."""

from __future__ import annotations

from dist_infer.engine.api import load
from dist_infer.models.llama import LlamaMLP
from tests.support.checkpoints import hf_reference, write_hf_checkpoint
from tests.support.hf_compare import assert_outputs_match_hf, prompts_for


def test_mlp_in_row_slices_matches_hf(world_groups, tmp_path, monkeypatch):
    """A prefill longer than LlamaMLP.ROW_CHUNK runs the MLP slice by slice (its temporaries are a long
    prefill's memory peak); with slices of 4 rows every prompt here is sliced, and the result is HF's."""
    monkeypatch.setattr(LlamaMLP, "ROW_CHUNK", 4)
    path = write_hf_checkpoint(tmp_path, "llama-gqa")
    prompts = prompts_for((5, 17, 40), seed=99)
    ids, logits = hf_reference(path, prompts, 4)
    outputs = load(path, groups=world_groups).generate(prompts, max_new_tokens=4, return_logits=True)
    assert_outputs_match_hf(outputs, prompts, ids, logits, "MLP in 4-row slices")

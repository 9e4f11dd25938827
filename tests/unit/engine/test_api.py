"""The single-process library path (world size 1, a gloo world of one rank: the `world_groups`
fixture of tests/unit/conftest.py): `api.shard` of an in-memory transformers model and `api.load`
of a checkpoint give HF's tokens and logits, sliding windows included."""

from __future__ import annotations

import pytest
from checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from hf_compare import assert_outputs_match_hf, prompts_for

from dist_infer.engine.api import ShardedModel, load, shard
from dist_infer.topology import Layout


@pytest.mark.parametrize("arch,overrides", [
    ("llama-gqa", {}),
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),  # every layer windowed
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),  # no layer windowed
])
def test_api_shard_in_memory_model_matches_hf(world_groups, tmp_path, arch, overrides):
    path = write_hf_checkpoint(tmp_path, arch, **overrides)
    hf_model = load_hf_model(path)
    prompts = prompts_for((5, 17, 40), seed=99)
    ids, logits = hf_reference(path, prompts, 6, model=hf_model)
    model = shard(hf_model, Layout(), groups=world_groups)
    want_window = {"llama-gqa": None, "mistral": 8, "qwen2": 8 if overrides.get("max_window_layers") == 0 else None}[arch]
    assert isinstance(model, ShardedModel) and model.config.sliding_window == want_window
    outputs = model.generate(prompts, max_new_tokens=6, return_logits=True)
    assert_outputs_match_hf(outputs, prompts, ids, logits, f"api.shard {arch} {overrides}")


def test_api_load_matches_shard(world_groups, tmp_path):
    path = write_hf_checkpoint(tmp_path, "qwen2")
    prompts = prompts_for((9, 3), seed=99)
    ids, logits = hf_reference(path, prompts, 4)
    model = load(path, groups=world_groups, block_size=4)
    outputs = model.generate(prompts, max_new_tokens=4, return_logits=True)
    assert_outputs_match_hf(outputs, prompts, ids, logits, "api.load qwen2")

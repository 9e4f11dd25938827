"""The single-process library path (world size 1, a gloo world of one rank: the `world_groups`
fixture of tests/unit/conftest.py): `api.shard` of an in-memory transformers model and `api.load`
of a checkpoint give HF's tokens and logits, sliding windows included; both take `quantization`."""

from __future__ import annotations

import pytest
import torch

from dist_infer.engine.api import ShardedModel, load, shard
from dist_infer.topology import Layout
from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.gguf_files import write_llama_gguf
from tests.support.hf_compare import assert_outputs_match_hf, prompts_for
from tests.support.quantized_helpers import VOCAB_PROMPTS
from tests.support.threads import thread_groups


def test_a_model_that_joined_the_job_itself_leaves_it_on_close(tmp_path):
    """First in the module (before world_groups makes the module's world): load() joins a world of
    one, close() (here `with`) destroys it; closing again is a no-op."""
    import torch.distributed as dist

    path = write_hf_checkpoint(tmp_path, "llama-gqa")
    with load(path) as model:
        assert dist.is_initialized() and model.generate([[3, 4, 5]], max_new_tokens=2)[0].token_ids
    assert not dist.is_initialized()
    model.close()


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama-gqa", {}),
        ("mistral", {"sliding_window": 8}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),  # every layer windowed
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),  # no layer windowed
    ],
)
def test_api_shard_in_memory_model_matches_hf(world_groups, tmp_path, arch, overrides):
    path = write_hf_checkpoint(tmp_path, arch, **overrides)
    hf_model = load_hf_model(path)
    prompts = prompts_for((5, 17, 40), seed=99)
    ids, logits = hf_reference(path, prompts, 6, model=hf_model)
    model = shard(hf_model, Layout(), groups=world_groups)
    want_window = {"llama-gqa": None, "mistral": 8, "qwen2": 8 if overrides.get("max_window_layers") == 0 else None}[
        arch
    ]
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
    model.close()
    assert world_groups.world.size == 1 and torch.distributed.is_initialized(), "given groups stay the caller's"


def test_api_load_and_shard_take_quantization(tmp_path):
    """dist_infer.load / dist_infer.shard pass `quantization` through with the CLI's default, auto: a
    GGUF file stays quantized (and generates like transformers on it), an in-memory HF model loads as
    floats; 'none' and 'int4' are taken as given."""
    g = thread_groups(1, 1)[0]
    gguf = write_llama_gguf(tmp_path / "tied.gguf", qtype="Q8_0", tied=True, seed=5)
    hf = load_hf_model(write_hf_checkpoint(tmp_path / "hf", "llama-tied"))

    def quantized(model) -> int:
        return sum(getattr(m, "quantized", None) is not None for m in model.engine.stage.modules())

    auto = load(gguf, groups=g)
    assert quantized(auto) > 0 and auto.engine.stage.embed_tokens.weight is None
    assert quantized(load(gguf, groups=g, quantization="none")) == 0
    assert quantized(shard(hf, groups=g)) == 0
    assert quantized(shard(hf, groups=g, quantization="int4")) > 0
    ref_ids, ref_logits = hf_reference(gguf, VOCAB_PROMPTS, 4)
    for b, out in enumerate(auto.generate(VOCAB_PROMPTS, max_new_tokens=4, return_logits=True)):
        assert out.token_ids == ref_ids[b]
        torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=2e-4, rtol=1e-4)


def test_api_load_and_shard_take_speculative(world_groups, tmp_path):
    """`speculative=SpeculativeConfig(...)`: the library's generate verifies proposals, with HF's
    tokens and logits, and the engine counts its rounds."""
    from dist_infer.engine import SpeculativeConfig

    path = write_hf_checkpoint(tmp_path, "llama-gqa")
    hf_model = load_hf_model(path)
    phrase = [11, 42, 7, 93]
    prompts = [[5] + phrase * 3 + phrase[:2], [8, 9] + phrase * 2]
    ids, logits = hf_reference(path, prompts, 12, model=hf_model)
    for model in (
        load(path, groups=world_groups, speculative=SpeculativeConfig(ngram_min=1)),
        shard(hf_model, groups=world_groups, speculative=SpeculativeConfig(ngram_min=1)),
    ):
        outputs = model.generate(prompts, max_new_tokens=12, return_logits=True)
        assert_outputs_match_hf(outputs, prompts, ids, logits, "api speculative")
        assert model.engine.speculative.snapshot()["num_draft_tokens"] > 0
        model.close()

"""ModelConfig.from_hf: the fields of every supported dense architecture (from written checkpoints),
Qwen2's sliding window by max_window_layers, the MoE fields (Mixtral, Qwen2-MoE with its shared
expert and dense layers, Qwen3-MoE), and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_infer.models.config import ModelConfig, ModelConfigError
from tests.support.checkpoints import write_hf_checkpoint
from tests.support.moe_reference import MOE_CONFIG

# --- ModelConfig.from_hf -------------------------------------------------------------------------

DENSE_ARCHS = ("llama-gqa", "llama-mqa", "mistral", "qwen2", "llama-tied", "llama31-rope")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("units")
    return {arch: write_hf_checkpoint(root, arch) for arch in DENSE_ARCHS}


def test_model_config_from_each_arch(checkpoints):
    cfgs = {
        arch: ModelConfig.from_hf(json.loads((path / "config.json").read_text())) for arch, path in checkpoints.items()
    }
    for arch, cfg in cfgs.items():
        assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size) == (64, 2, 4, 16, 128), (
            arch
        )
        assert cfg.intermediate_size == 128 and cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 10000.0, arch
        assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1, arch
        assert not cfg.mlp_bias and not cfg.o_bias, arch
    assert cfgs["llama-gqa"].model_type == "llama" and cfgs["llama-gqa"].num_kv_heads == 2
    assert cfgs["llama-gqa"].rope_scaling is None and cfgs["llama-gqa"].sliding_window is None
    assert not cfgs["llama-gqa"].qkv_bias and not cfgs["llama-gqa"].tie_word_embeddings
    assert cfgs["llama-gqa"].max_positions == 128
    assert cfgs["llama-mqa"].num_kv_heads == 1
    assert cfgs["mistral"].model_type == "mistral" and cfgs["mistral"].sliding_window == 4096
    assert cfgs["qwen2"].model_type == "qwen2" and cfgs["qwen2"].qkv_bias and cfgs["qwen2"].sliding_window is None
    assert cfgs["llama-tied"].tie_word_embeddings
    rope = cfgs["llama31-rope"]
    assert rope.max_positions == 256
    assert rope.rope_scaling["rope_type"] == "llama3" and rope.rope_scaling["factor"] == 8.0
    assert rope.rope_scaling["original_max_position_embeddings"] == 32
    assert rope.rope_scaling["low_freq_factor"] == 1.0 and rope.rope_scaling["high_freq_factor"] == 4.0


def test_model_config_errors_name_the_field(checkpoints):
    base = json.loads((checkpoints["llama-gqa"] / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    broken = dict(base)
    del broken["vocab_size"]
    with pytest.raises(ModelConfigError, match="vocab_size"):
        ModelConfig.from_hf(broken, "x/config.json")


def test_qwen2_sliding_window_follows_max_window_layers(checkpoints):
    """HF Qwen2 windows only layers >= max_window_layers: all of them, none of them, or (unsupported) some."""
    base = json.loads((checkpoints["qwen2"] / "config.json").read_text())
    base.pop("layer_types", None)
    on = {**base, "use_sliding_window": True, "sliding_window": 8}
    assert ModelConfig.from_hf({**on, "max_window_layers": 0}).sliding_window == 8
    assert ModelConfig.from_hf({**on, "max_window_layers": 2}).sliding_window is None
    assert ModelConfig.from_hf({**on, "max_window_layers": 28}).sliding_window is None  # HF's default: no layer
    assert ModelConfig.from_hf({**on, "layer_types": ["sliding_attention"] * 2}).sliding_window == 8
    with pytest.raises(ModelConfigError, match="max_window_layers 1 of 2"):
        ModelConfig.from_hf({**on, "max_window_layers": 1})
    assert ModelConfig.from_hf({**base, "use_sliding_window": False, "sliding_window": 8}).sliding_window is None


# --- MoE fields ----------------------------------------------------------------------------------


def test_config_mixtral():
    cfg = ModelConfig.from_hf({**MOE_CONFIG, "model_type": "mixtral", "num_local_experts": 8})
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.qk_norm) == (8, 96, True, False)
    assert all(cfg.is_moe_layer(i) for i in range(4))


def test_config_qwen2_moe_layers_and_shared_expert():
    cfg = ModelConfig.from_hf(
        {
            **MOE_CONFIG,
            "model_type": "qwen2_moe",
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert cfg.shared_expert_intermediate_size == 48
    assert (cfg.norm_topk_prob, cfg.qkv_bias, cfg.o_bias) == (False, True, False)


def test_config_qwen3_moe():
    cfg = ModelConfig.from_hf(
        {
            **MOE_CONFIG,
            "model_type": "qwen3_moe",
            "num_local_experts": 8,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
        }
    )
    assert (cfg.num_experts, cfg.qk_norm, cfg.norm_topk_prob, cfg.qkv_bias) == (8, True, True, False)


def test_config_dense_has_no_experts():
    cfg = ModelConfig.from_hf({**MOE_CONFIG, "model_type": "llama"})
    assert cfg.num_experts == 0 and not cfg.is_moe_layer(0)


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be between 1 and the 8 experts"),
    ],
)
def test_config_errors(extra, needle):
    with pytest.raises(ModelConfigError, match=needle):
        ModelConfig.from_hf({**MOE_CONFIG, "model_type": "mixtral", "num_local_experts": 8, **extra})

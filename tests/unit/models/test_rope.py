"""RoPE against transformers: the inverse frequencies (llama3 and linear scaling) from HF's own
init functions, cos/sin of LlamaRotaryEmbedding, apply_rotary as rotate-half, and an unsupported
scaling refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from dist_infer.models.config import ModelConfig, ModelConfigError
from dist_infer.models.rope import Rotary, apply_rotary, inverse_frequencies

LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**kw)


@pytest.mark.parametrize(
    "hidden,heads,theta,scaling",
    [
        (4096, 32, 500000.0, LLAMA31_SCALING),  # Llama 3.1 8B
        (
            64,
            4,
            10000.0,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),  # the test checkpoint's
        (256, 2, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    ],
)
def test_inverse_frequencies_match_transformers(hidden, heads, theta, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = _hf_llama_config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=131072,
        rope_theta=theta,
        rope_scaling=dict(scaling),
    )
    want, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    assert attention_factor == 1.0
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    assert cfg.rope_theta == theta and cfg.rope_scaling["rope_type"] == scaling["rope_type"]
    got = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=0, rtol=1e-7)
    if scaling["rope_type"] == "llama3":
        plain = inverse_frequencies(cfg.head_dim, cfg.rope_theta)
        assert not torch.equal(got, plain), "the scaling changes something"
        wavelen = 2 * math.pi / plain
        short = wavelen < scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
        assert torch.equal(got[short], plain[short]), "short wavelengths are untouched"


def test_rotary_cos_sin_match_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    hf_cfg = _hf_llama_config(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_scaling=scaling)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    ours = Rotary(cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling)
    positions = torch.tensor([0, 1, 5, 31, 32, 33, 100, 255])
    cos_hf, sin_hf = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, 1, dtype=torch.float32), positions[None])
    cos, sin = ours.cos_sin(positions)
    torch.testing.assert_close(cos, cos_hf[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, sin_hf[0], atol=1e-6, rtol=1e-6)


def test_apply_rotary_is_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen)
    rot = Rotary(16, 64, 10000.0)
    cos, sin = rot.cos_sin(torch.arange(5) + 7)
    q_hf, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(apply_rotary(x, cos, sin), q_hf[0].transpose(0, 1))


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(ModelConfigError, match="yarn"):
        inverse_frequencies(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})

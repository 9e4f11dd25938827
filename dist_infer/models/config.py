"""The model hyper-parameters we need, read from a HF config.json (Llama, Mistral, Qwen2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

SUPPORTED = ("llama", "mistral", "qwen2")


class ModelConfigError(ValueError):
    """A config.json this build cannot run; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict] = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED:
            raise ModelConfigError(f"{source}: model_type {model_type!r} is not supported; expected one of {SUPPORTED}")

        def need(key: str):
            if key not in cfg:
                raise ModelConfigError(f"{source}: missing required field {key!r}")
            return cfg[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type in (None, "default") else {**rope, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(need("vocab_size")),
            max_positions=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

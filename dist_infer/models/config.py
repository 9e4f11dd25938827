"""The model hyper-parameters we need, read from a HF config.json (Llama, Mistral, Qwen2, and the
mixture-of-experts families Mixtral, Qwen2-MoE and Qwen3-MoE)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from dist_infer.arg_types import parse_ladder_residual

DENSE_TYPES = ("llama", "mistral", "qwen2")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED = DENSE_TYPES + MOE_TYPES


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
    # Mixture of experts (num_experts 0: a dense model). intermediate_size stays the dense MLP's.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = field(default_factory=tuple)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    # Ladder Residual (arXiv 2501.06589): decoder layers FIRST..LAST (both included) add their attention
    # and MLP outputs to the residual one module later (models/ladder.py); None: the standard residual.
    ladder_layers: Optional[tuple] = None

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer `index` has experts (HF's rule: not in mlp_only_layers, every
        decoder_sparse_step-th layer)."""
        return (
            self.num_experts > 0 and index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED:
            raise ModelConfigError(f"{source}: model_type {model_type!r} is not supported; expected one of {SUPPORTED}")

        def need(key: str):
            if key not in cfg:
                raise ModelConfigError(f"{source}: missing required field {key!r}")
            return cfg[key]

        _check_sizes(cfg, source)
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type in (None, "default") else {**rope, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            window = None
        if model_type == "qwen2_moe" and window:
            raise ModelConfigError(f"{source}: use_sliding_window with qwen2_moe (per-layer windows) is not supported")
        if model_type == "qwen2" and window:
            # HF Qwen2 windows only layers >= max_window_layers (or as layer_types lists); the rest attend fully.
            n_layers, first = int(need("num_hidden_layers")), int(cfg.get("max_window_layers", 28))
            types = cfg.get("layer_types") or [
                "sliding_attention" if i >= first else "full_attention" for i in range(n_layers)
            ]
            kinds = {t == "sliding_attention" for t in types}
            if kinds == {False}:
                window = None
            elif kinds != {True}:
                raise ModelConfigError(
                    f"{source}: use_sliding_window with a window on only some layers (max_window_layers {first} of "
                    f"{n_layers}) is not supported"
                )
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        elif model_type == "qwen2_moe":
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        moe = _moe_fields(model_type, cfg, need, source) if model_type in MOE_TYPES else {}
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
            ladder_layers=ladder_from_json(cfg.get("ladder_residual"), int(need("num_hidden_layers")), source),
            **moe,
        )


def ladder_from_json(value: Any, num_layers: int, source: str) -> Optional[tuple[int, int]]:
    """config.json's `ladder_residual`: true or "all" (every layer), an int FIRST (FIRST to the last
    layer), [FIRST, LAST] (both included); false / null / absent: none."""
    if value is None or value is False:
        return None
    if value is True or value == "all":
        return (0, num_layers - 1)
    if isinstance(value, int) and not isinstance(value, bool):
        return ladder_span((value, num_layers - 1), num_layers, f"{source}: ladder_residual {value!r}")
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return ladder_span(tuple(value), num_layers, f"{source}: ladder_residual {value!r}")
    raise ModelConfigError(
        f'{source}: ladder_residual must be true, "all", a first layer or [first, last], got {str(value)[:40]!r}'
    )


def ladder_span(span: tuple[int, int], num_layers: int, what: str) -> tuple[int, int]:
    first, last = span
    if not 0 <= first <= last < num_layers:
        raise ModelConfigError(f"{what}: need 0 <= first <= last < {num_layers} (the model's layers)")
    return (first, last)


def with_ladder(cfg: ModelConfig, spec: Any) -> ModelConfig:
    """`cfg` with the --ladder-residual override `spec`: its text ('all', 'off', 'FIRST:LAST'), or
    parse_ladder_residual's result; None: config.json's choice stands."""
    if isinstance(spec, str):
        spec = parse_ladder_residual(spec)
    if spec is None:
        return cfg
    if spec == "off":
        layers = None
    elif spec == "all":
        layers = (0, cfg.num_layers - 1)
    else:
        layers = ladder_span(tuple(spec), cfg.num_layers, f"--ladder-residual {spec[0]}:{spec[1]}")
    return dataclasses.replace(cfg, ladder_layers=layers)


MAX_POSITIONS = 1 << 24  # the rotary tables are sized by it: a hostile config must not ask for terabytes


def _check_sizes(cfg: dict[str, Any], source: str) -> None:
    """An untrusted config.json's sizes: whole numbers >= 1 where the model divides or allocates by
    them, KV heads dividing the heads, a bounded context; each error names the field."""

    def whole(key: str, low: int = 1, high: int = 1 << 31) -> None:
        value = cfg.get(key)
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ModelConfigError(
                f"{source}: {key} must be a whole number in [{low}, {high}], got {str(value)[:40]!r}"
            )

    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
        "num_key_value_heads",
        "head_dim",
    ):
        whole(key)
    whole("max_position_embeddings", 1, MAX_POSITIONS)
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ModelConfigError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if heads and not cfg.get("head_dim") and cfg.get("hidden_size") and cfg["hidden_size"] % heads:
        raise ModelConfigError(
            f"{source}: hidden_size {cfg['hidden_size']} is not a multiple of "
            f"num_attention_heads {heads} (and no head_dim is given)"
        )


def _moe_fields(model_type: str, cfg: dict[str, Any], need, source: str) -> dict[str, Any]:
    """The expert fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported for experts (silu is)")
    key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"  # Qwen3-MoE writes either
    experts = int(need(key))
    if model_type == "mixtral":
        fields = dict(moe_intermediate_size=int(need("intermediate_size")), norm_topk_prob=True)
    else:
        fields = dict(
            moe_intermediate_size=int(need("moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )
    if model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size") or 0)
    top_k = int(need("num_experts_per_tok"))
    if not 1 <= top_k <= experts:
        raise ModelConfigError(f"{source}: num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
    return dict(num_experts=experts, num_experts_per_tok=top_k, qk_norm=model_type == "qwen3_moe", **fields)

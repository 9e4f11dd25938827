"""What one rank of a layout holds and computes, counted from the model's config.

Pure arithmetic: parameter counts per layer and per rank, FLOPs of the linear layers and of
causal attention, KV bytes per token. The head split is the engine's own (HeadLayout: uneven
splits allowed), and the critical path is the rank with the most heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dist_infer.models.config import ModelConfig
from dist_infer.parallel.sharding import HeadLayout, shard_range


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    moe_layers: int = 0  # layers with experts (the rest have the dense MLP)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "ModelShape":
        moe_layers = sum(1 for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
        return cls(
            hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size,
            layers=cfg.num_layers,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            vocab=cfg.vocab_size,
            tied=cfg.tie_word_embeddings,
            experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            expert_intermediate=cfg.moe_intermediate_size,
            shared_expert_intermediate=cfg.shared_expert_intermediate_size,
            moe_layers=moe_layers,
        )

    # -- whole model ---------------------------------------------------------------------------
    def attention_params(self) -> int:
        d, h = self.head_dim, self.hidden
        return h * self.heads * d * 2 + h * self.kv_heads * d * 2  # q and o, k and v

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    def total_params(self) -> int:
        dense_layers = self.layers - self.moe_layers
        moe = self.moe_layers * (
            self.experts * self.expert_params()
            + 3 * self.hidden * self.shared_expert_intermediate
            + self.hidden * self.experts
        )
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.attention_params() + dense_layers * self.dense_mlp_params() + moe + embed

    # -- one tensor-parallel rank (the one with the most heads) -------------------------------
    def heads_per_rank(self, tp: int) -> tuple[int, int]:
        """(query heads, KV heads) of the busiest tp rank."""
        layouts = [HeadLayout(self.heads, self.kv_heads, tp, r) for r in range(tp)]
        return max(lay.q_heads for lay in layouts), max(lay.kv_heads for lay in layouts)

    def attention_params_per_rank(self, tp: int) -> int:
        q, kv = self.heads_per_rank(tp)
        return self.hidden * self.head_dim * (2 * q + 2 * kv)

    def mlp_params_per_rank(self, tp: int, ep: int = 1, moe: bool = False) -> int:
        """A dense MLP split over tp; an MoE layer's experts split over ep (whole experts), each
        expert's intermediate dimension over tp; the router replicated."""
        if not moe:
            return 3 * self.hidden * max_shard(self.intermediate, tp)
        if not self.experts:
            return 0
        experts = math.ceil(self.experts / ep)
        shared = max_shard(self.shared_expert_intermediate, tp) if self.shared_expert_intermediate else 0
        return (
            experts * 3 * self.hidden * max_shard(self.expert_intermediate, tp)
            + 3 * self.hidden * shared
            + self.hidden * self.experts
        )

    def vocab_per_rank(self, tp: int) -> int:
        return max_shard(self.vocab, tp)

    def kv_bytes_per_token(self, tp: int, layers: int, elem_bytes: float) -> float:
        """KV cache bytes one token costs on one rank holding `layers` layers."""
        _, kv = self.heads_per_rank(tp)
        return 2 * kv * self.head_dim * elem_bytes * layers


def max_shard(size: int, parts: int) -> int:
    return max(shard_range(size, parts, r)[1] for r in range(parts))


def causal_attention_flops(q_heads: int, head_dim: int, new_tokens: int, context_before: int = 0) -> float:
    """QK^T and PV for `new_tokens` queries, each seeing the `context_before` cached keys and the
    new ones up to itself: 4 * d * heads * (query, key) pairs."""
    pairs = new_tokens * context_before + new_tokens * (new_tokens + 1) / 2
    return 4.0 * head_dim * q_heads * pairs


def linear_flops(params: int, tokens: float) -> float:
    return 2.0 * params * tokens

"""Small random HF checkpoints and HF's own greedy output for them: the ground truth of the tests.

Each architecture the engine claims to load gets a tiny seeded model written with
`save_pretrained`, so tests read exactly the files (names, config keys, sharding, tying) that
transformers produces. Weights use std 0.1 rather than HF's 0.02 and norms/biases are made
non-trivial, so greedy decoding is not decided by near-ties and a wrongly loaded norm or
bias changes the output.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch

ARCHS = (
    "llama-gqa",
    "llama-mqa",
    "mistral",
    "qwen2",
    "llama-tied",
    "llama31-rope",
    "mixtral",
    "qwen2-moe",
    "qwen3-moe",
)

# Mixture of experts: 8 small experts, top-2, as the dense archs otherwise.
_MOE = dict(num_experts_per_tok=2)

_BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    intermediate_size=128,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _model_and_config(arch: str, overrides: dict):
    import transformers as tf

    kwargs = dict(_BASE)
    if arch == "llama-gqa":
        cls, cfg = tf.LlamaForCausalLM, tf.LlamaConfig
    elif arch == "llama-mqa":
        cls, cfg = tf.LlamaForCausalLM, tf.LlamaConfig
        kwargs["num_key_value_heads"] = 1
    elif arch == "mistral":
        cls, cfg = tf.MistralForCausalLM, tf.MistralConfig
        kwargs["head_dim"] = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    elif arch == "qwen2":
        cls, cfg = tf.Qwen2ForCausalLM, tf.Qwen2Config
    elif arch == "llama-tied":
        cls, cfg = tf.LlamaForCausalLM, tf.LlamaConfig
        kwargs["tie_word_embeddings"] = True
    elif arch == "llama31-rope":
        cls, cfg = tf.LlamaForCausalLM, tf.LlamaConfig
        kwargs["max_position_embeddings"] = 256
        kwargs["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    elif arch == "mixtral":
        cls, cfg = tf.MixtralForCausalLM, tf.MixtralConfig
        kwargs.update(_MOE, num_local_experts=8, intermediate_size=64)
    elif arch == "qwen2-moe":  # shared expert, no top-k renormalisation, layer 1 dense (mlp_only_layers)
        cls, cfg = tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig
        kwargs.update(
            _MOE,
            num_experts=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            num_hidden_layers=3,
            mlp_only_layers=[1],
        )
    elif arch == "qwen3-moe":  # q_norm / k_norm, top-k renormalised
        cls, cfg = tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig
        kwargs.update(_MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)
    else:
        raise ValueError(f"unknown test architecture {arch!r}; known: {', '.join(ARCHS)}")
    kwargs.update(overrides)
    return cls, cfg(**kwargs)


def write_hf_checkpoint(
    tmpdir: Union[str, os.PathLike],
    arch: str,
    *,
    seed: int = 0,
    init_std: float = 0.1,
    max_shard_size: Optional[Union[int, str]] = None,
    subdir: Optional[str] = None,
    force_experts: Optional[tuple[int, ...]] = None,
    **overrides,
) -> Path:
    """Write a seeded random `arch` model with save_pretrained into tmpdir/<subdir or arch>.

    `overrides` go to the config (e.g. num_hidden_layers=3); `max_shard_size` (e.g. "100KB")
    forces several shards plus model.safetensors.index.json. Same arguments, same bytes.
    `force_experts` (MoE archs): make every router of the model pick exactly these experts
    for every token (see `force_routing`).
    """
    cls, config = _model_and_config(arch, {"initializer_range": init_std, **overrides})
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(init_std * torch.randn(param.shape, generator=gen))
        if force_experts is not None:
            force_routing(model, force_experts)
    out = Path(tmpdir) / (subdir or arch)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return out


def force_routing(model, experts: tuple[int, ...], dim: int = 0, level: float = 4.0, pull: float = 3.0) -> None:
    """Make every token of every MoE layer route to `experts` (top-k = len(experts)), whatever the input.

    Hidden dimension `dim` of the residual stream is made a large constant: every embedding row
    holds `level` there and nothing writes to it afterwards (o_proj and every down projection
    have that output row zeroed), so after each RMSNorm it is the dominant, positive component.
    Each router's weight on it is +`pull` for the chosen experts and -`pull` for the rest, a
    logit margin far above what the other dimensions add. The LM head ignores `dim`.
    """
    state = dict(model.named_parameters())
    state["model.embed_tokens.weight"][:, dim] = level
    for name, param in state.items():
        if name.endswith("o_proj.weight") or ("down_proj" in name and name.endswith((".weight", "down_proj"))):
            if param.dim() == 3:  # fused experts [E, H, I]
                param[:, dim, :] = 0.0
            else:
                param[dim, :] = 0.0
        elif name.endswith("mlp.gate.weight"):  # the router [E, H]
            param[:, dim] = -pull
            param[list(experts), dim] = pull
    if "lm_head.weight" in state:
        state["lm_head.weight"][:, dim] = 0.0


def load_hf_model(path: Union[str, os.PathLike]):
    """The checkpoint as HF loads it: fp32, eager attention (the reference implementation)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix == ".gguf":  # transformers dequantizes a GGUF to fp32 itself
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.no_grad()
def hf_reference(
    path: Union[str, os.PathLike], prompts: list[list[int]], max_new_tokens: int, model=None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF greedy decoding, one prompt at a time with its KV cache, never stopping at EOS.

    Returns, per prompt, the `max_new_tokens` generated ids (prompt excluded) and a
    [max_new_tokens, vocab] fp32 tensor of logits: row 0 is the prefill's last position,
    row k the decode step that consumed generated token k-1.
    """
    model = model if model is not None else load_hf_model(path)
    all_ids: list[list[int]] = []
    all_logits: list[torch.Tensor] = []
    for prompt in prompts:
        if not prompt:
            raise ValueError("hf_reference: empty prompt")
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        ids: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(max_new_tokens):
            logits = out.logits[0, -1].float()
            rows.append(logits.clone())
            ids.append(int(logits.argmax()))
            if step + 1 < max_new_tokens:
                out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        all_ids.append(ids)
        vocab = (
            model.config.get_text_config().vocab_size
            if hasattr(model.config, "get_text_config")
            else model.config.vocab_size
        )
        all_logits.append(torch.stack(rows) if rows else torch.empty(0, vocab))
    return all_ids, all_logits

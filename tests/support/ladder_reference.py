"""A plain single-process torch reference of the Ladder Residual forward (models/ladder.py).

transformers has no ladder model, so this is a few lines of torch over the HF model's own weights
and modules (embedding, norms, MLP or expert block, LM head; attention written out): the ladder
wiring of arXiv 2501.06589, recomputing every prefix in full (no KV cache). Used by
tests/unit/models/test_ladder_residual.py and tests/integration/test_ladder_processes.py."""

from __future__ import annotations

import torch

from dist_infer.models.config import ModelConfig


def _attention(attn, h: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    T, nh, nkv, hd = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = (proj(h).view(T, -1, hd) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rope = lambda t: t * cos + torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1) * sin  # noqa: E731
    q, k = rope(q), rope(k).repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(nh // nkv, 1))
    return attn.o_proj(out.reshape(T, -1))


def _mlp(layer, h: torch.Tensor) -> torch.Tensor:
    y = layer.mlp(h[None])
    return (y[0] if isinstance(y, tuple) else y).reshape(h.shape)


@torch.no_grad()
def reference_logits(hf, ids: list[int], ladder=None) -> torch.Tensor:
    """Logits [T, vocab] of every position; `ladder` (FIRST, LAST): those layers laddered."""
    x, cfg = hf.model.embed_tokens(torch.tensor(ids)), ModelConfig.from_hf(hf.config.to_dict())
    prev_attn = prev_mlp = None
    for i, layer in enumerate(hf.model.layers):
        if ladder and ladder[0] <= i <= ladder[1]:
            if prev_attn is not None:
                x = x + prev_attn
            attn_out = _attention(layer.self_attn, layer.input_layernorm(x), cfg)
            if prev_mlp is not None:
                x = x + prev_mlp
            prev_attn, prev_mlp = attn_out, _mlp(layer, layer.post_attention_layernorm(x))
            continue
        if prev_attn is not None:
            x, prev_attn, prev_mlp = x + prev_attn + prev_mlp, None, None
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cfg)
        x = x + _mlp(layer, layer.post_attention_layernorm(x))
    if prev_attn is not None:
        x = x + prev_attn + prev_mlp
    return hf.lm_head(hf.model.norm(x))


def reference_greedy(hf, prompt: list[int], ladder, new: int) -> tuple[list[int], torch.Tensor]:
    """`new` greedy tokens after `prompt` (never stopping at EOS) and the [new, vocab] logits that chose them."""
    ids, rows = list(prompt), []
    for _ in range(new):
        rows.append(reference_logits(hf, ids, ladder)[-1])
        ids.append(int(rows[-1].argmax()))
    return ids[len(prompt) :], torch.stack(rows)

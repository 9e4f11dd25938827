"""Rotary position embeddings, including Llama 3.1's frequency scaling. Pure functions."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from dist_infer.models.config import ModelConfigError


def llama3_scale(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_positions: int
) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    low_wavelen = original_max_positions / low_freq_factor
    high_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[dict] = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return llama3_scale(
            inv_freq,
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    raise ModelConfigError(f"rope scaling type {kind!r} is not supported (default, linear, llama3 are)")


class Rotary(nn.Module):
    """cos/sin per position, computed once for all positions the model can see.

    A module with the tables as buffers (not saved with the weights), so they go wherever the
    model is moved (`stage.to("cuda")`) and a step's positions, on the model's device, index
    them there. They stay fp32 whatever dtype the model is cast to: `apply_rotary` casts them
    to the activations' dtype itself, like HF."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[dict] = None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """Follow the model's moves (`fn` tells where to) but not its casts: the fp32 tables go there."""
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        self.cos, self.sin = cos.to(self.cos.device), sin.to(self.sin.device)
        return self

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (the rotate-half convention).
    The tables are fp32; like HF, they are cast to x's dtype first, so bf16 stays bf16."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)

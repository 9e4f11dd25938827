"""Choosing the next token: greedy, or temperature with top-k and top-p.

Each sequence draws from its own generator seeded from (seed, sequence index), so a seeded run
gives the same tokens on every rank and however the batch is cut into microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int = 0
    stop_at_eos: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sequence_generator(seed: int, index: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed * 1_000_003 + index)
    return gen


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest top-p nucleus."""
    logits = logits.clone()
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p  # keeps the first token always
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token ids [B], log-probabilities of those tokens under the model [B])."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        tokens = logits.argmax(-1)
    else:
        probs = filter_logits(logits / params.temperature, params.top_k, params.top_p).softmax(-1)
        tokens = torch.stack([torch.multinomial(probs[b], 1, generator=generators[b])[0] for b in range(len(generators))])
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]

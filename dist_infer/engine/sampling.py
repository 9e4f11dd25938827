"""Choosing the next token: greedy, or temperature with top-k and top-p, per request.

Randomness is counter-based: token i of a request is drawn from a generator seeded from
(seed, i). A request's whole random state is therefore its seed and how many tokens it has,
so it samples the same tokens alone or in any batch, at any chunk size, after a preemption
(recompute) and after moving to another instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

MAX_LOGPROBS = 20  # top alternatives a request may ask for (vLLM's default limit)


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; `field` names it (the HTTP API reports it as `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: Optional[int] = 0  # None: the engine draws one per request
    stop_at_eos: bool = True
    stop_token_ids: tuple[int, ...] = ()  # more ids that end the request (the id is kept in the output)
    stop: tuple[str, ...] = ()  # strings that end the request; the text is cut before them
    logprobs: Optional[int] = None  # also return this many top alternatives per token (0: the chosen one only)
    min_tokens: int = 0  # no stop (EOS, stop ids, stop strings) before this many tokens

    def __post_init__(self):
        def bad(name, why):
            raise SamplingParamsError(name, f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an integer >= 1")
        if not 0 <= self.temperature <= 100:
            bad("temperature", "must be in [0, 100]")
        if self.top_k < 0:
            bad("top_k", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 2 ** 53:
            bad("seed", "must be in [0, 2**53)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            bad("min_tokens", f"must be in [0, max_new_tokens={self.max_new_tokens}]")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def token_generator(seed: int, index: int) -> torch.Generator:
    """The generator for token `index` of a request seeded with `seed` (counter-based)."""
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + index * 7_919 + 1) % (2 ** 63))
    return gen


def batch_seed(seed: Optional[int], index: int) -> Optional[int]:
    """The seed of request `index` of a batch submitted with one seed (each its own stream)."""
    return None if seed is None else (seed * 1_000_003 + index) % (2 ** 52)


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


@dataclass
class RowSampling:
    """How to sample one row of logits: the request's parameters and the index of the token drawn."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    index: int = 0  # tokens the request has generated before this one
    logprobs: int = 0  # top alternatives wanted
    ban_eos: int = 0  # 1: EOS may not be drawn (the request is below its min_tokens)

    @classmethod
    def of(cls, params: SamplingParams, seed: int, index: int) -> "RowSampling":
        ban = int(params.stop_at_eos and index < params.min_tokens)
        return cls(params.temperature, params.top_k, params.top_p, seed, index, params.logprobs or 0, ban)


@dataclass
class SampledTokens:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float64: log-probability of each chosen token under the model
    top_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))  # [B, N]
    top_logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.float64))  # [B, N]
    logits: Optional[torch.Tensor] = None  # [B, V] fp32, when the caller asked for them


def sample_rows(logits: torch.Tensor, rows: list[RowSampling], eos_ids: tuple[int, ...] = ()) -> SampledTokens:
    """logits [B, V] -> one token per row, each row with its own parameters and generator."""
    logits = logits.float()
    banned = [b for b, r in enumerate(rows) if r.ban_eos]
    if banned and eos_ids:
        logits = logits.clone()
        logits[torch.tensor(banned)[:, None], torch.tensor(list(eos_ids))[None, :]] = float("-inf")
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(-1)
    for b, row in enumerate(rows):
        if row.temperature > 0:
            probs = filter_logits(logits[b] / row.temperature, row.top_k, row.top_p).softmax(-1)
            tokens[b] = torch.multinomial(probs, 1, generator=token_generator(row.seed, row.index))[0]
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].double()
    n = max((r.logprobs for r in rows), default=0)
    if n:
        top = logprobs.topk(n, dim=-1)
        return SampledTokens(tokens, chosen, top.indices, top.values.double())
    return SampledTokens(tokens, chosen)

"""Choosing the next token: greedy, or temperature with top-k and top-p, per request.

Randomness is counter-based: token i of a request is drawn from a generator seeded from
(seed, i). A request's whole random state is therefore its seed and how many tokens it has,
so it samples the same tokens alone or in any batch, at any chunk size, after a preemption
(recompute) and after moving to another instance.

Every parameter in range gives a token: temperatures below GREEDY_BELOW are greedy (dividing by
1e-300 would overflow), top-p keeps the most likely token however small it is, top-k is clamped
to the vocabulary, and non-finite logits from the model are made finite before any softmax.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from dist_infer.engine.structured.spec import StructuredSpec

MAX_LOGPROBS = 20  # top alternatives a request may ask for (vLLM's default limit)
MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily, as vLLM's _SAMPLING_EPS
TOP_K_LIMIT = 2**31 - 1  # top_k is kept clamped to this: above any vocabulary, exact in the float64 step plan
MAX_STOP_TOKEN_IDS = 256  # a 16 MiB body could carry millions, checked per token and pickled with every move
MAX_CACHE_SALT_CHARS = 256  # a cache salt names a group of requests: a key's worth, hashed with each prompt


def is_greedy(temperature: float) -> bool:
    """Whether a temperature means greedy: 0, anything too small to divide by, or NaN."""
    return not temperature >= GREEDY_BELOW


def _shown(value: Any) -> str:
    """A value for an error message, short even for a 5000-digit integer (whose repr raises)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


def _as_integer(value: Any) -> Optional[int]:
    """`value` as an int when it is a whole number (40 or 40.0), else None."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; `field` names it (the HTTP API reports it as `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _stop_token_ids(ids: Any) -> tuple[int, ...]:
    """`ids` as a tuple of whole numbers >= 0, at most MAX_STOP_TOKEN_IDS of them, else
    SamplingParamsError naming stop_token_ids (the size is checked before anything is copied)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or not hasattr(ids, "__iter__"):
        raise SamplingParamsError("stop_token_ids", f"stop_token_ids must be a list of token ids, got {_shown(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingParamsError(
            "stop_token_ids", f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
        )
    out = tuple(_as_integer(t) for t in ids)
    bad = [t for t, whole in zip(ids, out) if whole is None or whole < 0]
    if bad:
        raise SamplingParamsError("stop_token_ids", f"stop_token_ids must be whole numbers >= 0, got {_shown(bad[0])}")
    return out


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
    # not a sampling choice, but it travels wherever the request does (add, resume, migration): requests
    # share cached prefix blocks only when their salts are equal (engine/prefix_cache.py; vLLM's cache_salt)
    cache_salt: Optional[str] = field(default=None, repr=False)
    # what the output must look like (a JSON schema, regex, choice, grammar: engine/structured); the
    # engine checks it against the model's tokenizer when the request is made (StructuredSpecError)
    structured: Optional[StructuredSpec] = None
    # stop_token_ids as a set, made once here: the step loop checks every decoded token against it
    stop_token_set: frozenset[int] = field(default=frozenset(), init=False, compare=False, repr=False)

    def __post_init__(self):
        def bad(name, why):
            raise SamplingParamsError(name, f"{name} {why}, got {_shown(getattr(self, name))}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            bad("max_new_tokens", "must be an integer >= 1")
        if not 0 <= self.temperature <= 100:
            bad("temperature", "must be in [0, 100]")
        top_k = _as_integer(self.top_k)
        if top_k is None or top_k < 0:
            bad("top_k", "must be an integer >= 0")
        object.__setattr__(self, "top_k", min(top_k, TOP_K_LIMIT))
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (_as_integer(self.seed) is None or not 0 <= self.seed < 2**53):
            bad("seed", "must be an integer in [0, 2**53)")
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            bad("min_tokens", f"must be in [0, max_new_tokens={self.max_new_tokens}]")
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            bad("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            bad("structured", "must be a StructuredSpec (engine/structured/spec.py) or None")
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "stop_token_set", frozenset(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def token_generator(seed: int, index: int, device: torch.device = torch.device("cpu")) -> torch.Generator:
    """The generator for token `index` of a request seeded with `seed` (counter-based), on the
    device whose tensors it draws for (a CUDA draw takes a CUDA generator)."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + index * 7_919 + 1) % (2**63))
    return gen


def batch_seed(seed: Optional[int], index: int) -> Optional[int]:
    """The seed of request `index` of a batch submitted with one seed (each its own stream)."""
    return None if seed is None else (seed * 1_000_003 + index) % (2**52)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest top-p nucleus.

    The most likely token always stays: top_k is clamped to the vocabulary (any int, 10**400
    included), and a top_p that rounds to 0 in float32 (1e-50) still keeps the first token."""
    logits = logits.clone()
    top_k = min(top_k, logits.shape[-1])
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, int(top_k), dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False  # the first token stays whatever top_p is
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
    # EOS may not be drawn (the request is below its min_tokens) when > 0: the count of tokens from this
    # one that are below it (a speculating row's later positions lift the ban: step_plan.position_rows)
    ban_eos: int = 0

    @classmethod
    def of(cls, params: SamplingParams, seed: int, index: int) -> "RowSampling":
        ban = max(0, params.min_tokens - index) if params.stop_at_eos else 0
        temperature = 0.0 if params.greedy else params.temperature
        return cls(temperature, params.top_k, params.top_p, seed, index, params.logprobs or 0, ban)


@dataclass
class SampledTokens:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float64: log-probability of each chosen token under the model
    top_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))  # [B, N]
    top_logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.float64))  # [B, N]
    logits: Optional[torch.Tensor] = None  # [B, V] fp32, when the caller asked for them


def usable_logits(
    logits: torch.Tensor, banned: Optional[torch.Tensor] = None, read_host: Optional[bool] = None
) -> torch.Tensor:
    """fp32 logits every softmax can take: NaN -> -inf, +inf -> the largest float, `banned` [B, V]
    -> -inf. A row left with no finite logit (all NaN, or only banned tokens) becomes uniform over its
    allowed tokens, or over all when none is allowed, so every row still has a token to give.
    `banned` None (the usual step: nothing banned) skips the ban's mask and its uniform rows, a
    third of the kernels on a device.

    `read_host` (default: the logits are on the CPU): find the dead rows with a host read, free on
    the CPU; on a device the same values come without it (no sync), by a select over every row,
    which on the CPU would cost far more than the host read (a select over every logit of a
    large batch and vocabulary, every step)."""
    fp32 = torch.finfo(torch.float32)
    out = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=fp32.max, neginf=float("-inf"))
    if banned is not None:
        out = out.masked_fill(banned, float("-inf"))
    dead = out.amax(-1) == float("-inf")  # only -inf is left non-finite
    if not (out.device.type == "cpu" if read_host is None else read_host):
        if banned is None:
            return out.masked_fill(dead[:, None], 0.0)
        return torch.where(dead[:, None], _uniform_over_allowed(banned), out)
    if dead.any():
        out[dead] = 0.0 if banned is None else _uniform_over_allowed(banned[dead])
    return out


def _uniform_over_allowed(banned: torch.Tensor) -> torch.Tensor:
    """Equal logits (0) for the allowed tokens of each row, -inf for the banned; all 0 where all are banned."""
    uniform = torch.zeros(banned.shape, dtype=torch.float32, device=banned.device).masked_fill(banned, float("-inf"))
    return uniform.masked_fill(~torch.isfinite(uniform).any(-1, keepdim=True), 0.0)


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature (one row with a finite max). Where that overflows (|logit| > ~3e33 at
    temperature 1e-5) the same distribution from the row max down, (logits - max) / temperature,
    which can only underflow to -inf (a probability of 0 either way)."""
    scaled = logits / temperature
    overflowed = torch.isinf(scaled)
    if overflowed.any() and (overflowed & torch.isfinite(logits)).any():
        scaled = (logits - logits.max()) / temperature
    return scaled


def row_probs(logits: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """The distribution a sampled (not greedy) row draws from, for one row of usable logits: its
    temperature (capped at MAX_TEMPERATURE), then top-k and top-p. Speculative verification
    (engine/speculative) accepts draft tokens against this same vector."""
    temperature = min(row.temperature, MAX_TEMPERATURE)
    return filter_logits(scaled_logits(logits, temperature), row.top_k, row.top_p).softmax(-1)


def draw_token(logits: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """One token from one row of usable logits, with the row's own counter-based generator."""
    probs = row_probs(logits, row)
    token = torch.multinomial(probs, 1, generator=token_generator(row.seed, row.index, probs.device))[0]
    # only on a uniform draw of exactly 0 ahead of zero-probability tokens: on the CPU a read and a
    # rare argmax; on a device chosen there, without a host read
    if probs.device.type == "cpu":
        return token if probs[token] > 0 else probs.argmax()
    return torch.where(probs[token] > 0, token, probs.argmax())


def sample_rows(logits: torch.Tensor, rows: list[RowSampling], eos_ids: tuple[int, ...] = ()) -> SampledTokens:
    """logits [B, V] -> one token per row, each row with its own parameters and generator.

    Never raises on what a model or a valid request can give: every chosen token has a finite logprob."""
    banned_rows = [b for b, r in enumerate(rows) if r.ban_eos]
    if banned_rows and eos_ids:
        at = logits.device
        banned = torch.zeros(logits.shape, dtype=torch.bool, device=at)
        banned[torch.tensor(banned_rows, device=at)[:, None], torch.tensor(list(eos_ids), device=at)[None, :]] = True
        logits = usable_logits(logits, banned)
    else:
        logits = usable_logits(logits)
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(-1)
    for b, row in enumerate(rows):
        if not is_greedy(row.temperature):
            tokens[b] = draw_token(logits[b], row)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].double()
    n = min(max((r.logprobs for r in rows), default=0), logits.shape[-1])
    if n:
        top = logprobs.topk(n, dim=-1)
        return SampledTokens(tokens, chosen, top.indices, top.values.double())
    return SampledTokens(tokens, chosen, tokens.new_zeros(0, 0), chosen.new_zeros(0, 0))  # all on the logits' device

"""What a forward step costs, learned while serving, and the prompt tokens that fit a latency target.

Sarathi-Serve keeps decodes stall-free by sizing each step's prompt chunk to a token-latency target,
from a profile taken before serving. Here the profile is learned online from the steps the engine
runs, so it fits any model, layout (pp included) and machine without a calibration pass:

    step seconds ~ fixed + f [P > 0] + a P + c (P s + P^2 / 2) / 1000 + b D + e L / 1000 + g R + h [R > 0]

P prompt tokens in the step, s the context they start from (their attention pairs grow with it),
D decoding sequences, L the decodes' context tokens (a decode reads its whole KV), R the proposed
tokens the decodes verify (speculative decoding: each a row more, attending its decode's context);
h is what a step with proposals pays on top, whatever their number (on the CPU, past 8 rows the
step leaves the skinny kernels, as a prompt chunk does). f is what a step
with prompt tokens pays on top, whatever its size: on the CPU a step of up to 8 rows runs the
skinny kernels and one with a prompt chunk BLAS products and the chunk's attention in GEMMs
(models/fused_decode.py), or one layer and one kernel at a time where the native stack does not
serve the model (docs/benchmarks.md, "Mixed steps in one native call"). The fit is a
least squares over recent steps with exponential forgetting (recursive least squares as a sum of
outer products), so it follows a machine whose speed drifts. Pure numpy: tested without processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from dist_infer.arg_types import AUTO_FACTOR, AUTO_FLOOR_S, parse_itl_target  # noqa: F401 (defined there for the CLI)

FEATURES = (
    "fixed",
    "prompt_step",
    "prompt_token",
    "prompt_pair_k",
    "decode_seq",
    "decode_context_k",
    "draft_token",
    "draft_step",
)
MIN_CHUNK = 16  # a prompt advances at least this much per step beside decodes: no starvation
STEP_KINDS = ("decode", "mixed", "prefill")
STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True)
class StepShape:
    """What a step held: its prompt tokens (and the context they start from) and its decodes."""

    prompt_tokens: int = 0
    prompt_pairs: float = 0.0  # sum over chunks of n (start + n / 2): attention pairs beyond the chunk's own
    decodes: int = 0
    decode_context: int = 0  # tokens the decodes attend to, summed
    draft_tokens: int = 0  # proposed tokens the decodes verify beside their own (speculative decoding)

    @property
    def kind(self) -> str:
        if self.prompt_tokens and self.decodes:
            return "mixed"
        return "prefill" if self.prompt_tokens else "decode"

    def features(self) -> np.ndarray:
        return np.array(
            [
                1.0,
                1.0 if self.prompt_tokens else 0.0,
                self.prompt_tokens,
                self.prompt_pairs / 1000.0,
                self.decodes,
                self.decode_context / 1000.0,
                self.draft_tokens,
                1.0 if self.draft_tokens else 0.0,
            ]
        )


def chunk_pairs(start: int, n: int) -> float:
    """Attention pairs of a chunk of `n` prompt tokens after `start` cached ones (the P s + P^2/2 term)."""
    return n * (start + n / 2.0)


@dataclass
class StepCostModel:
    """Seconds per step as a linear function of its shape, fitted online (see the module docstring)."""

    forget: float = 0.97  # weight of the past per observation: about the last 1 / (1 - forget) steps count
    ridge: float = 1e-6
    _xtx: np.ndarray = field(default_factory=lambda: np.zeros((len(FEATURES), len(FEATURES))))
    _xty: np.ndarray = field(default_factory=lambda: np.zeros(len(FEATURES)))
    _coef: Optional[np.ndarray] = None
    seen: dict = field(default_factory=lambda: {k: 0 for k in STEP_KINDS})
    _prompt_sizes: set = field(default_factory=set)  # distinct prompt token counts seen, up to two
    _draft_sizes: set = field(default_factory=set)  # distinct proposal counts seen, up to two

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        x = shape.features()
        self._xtx = self.forget * self._xtx + np.outer(x, x)
        self._xty = self.forget * self._xty + x * seconds
        self.seen[shape.kind] += 1
        if shape.prompt_tokens and len(self._prompt_sizes) < 2:
            self._prompt_sizes.add(shape.prompt_tokens)
        if shape.draft_tokens and len(self._draft_sizes) < 2:
            self._draft_sizes.add(shape.draft_tokens)
        self._coef = None

    @property
    def ready(self) -> bool:
        """Both a decode's and a prompt token's cost are known (a decode-only step and one with a prompt seen)."""
        return self.seen["decode"] > 0 and (self.seen["mixed"] + self.seen["prefill"]) > 0

    def coefficients(self) -> np.ndarray:
        """The fitted cost per feature (FEATURES order), none below zero."""
        if self._coef is None:
            reg = self.ridge * np.eye(len(FEATURES)) * max(1.0, float(np.trace(self._xtx)) / len(FEATURES))
            reg[0, 0] = 0.0
            reg[1, 1] = self.ridge * self._xtx[1, 1]  # the 0/1 prompt_step by its own scale, not the token counts
            use = np.ones(len(FEATURES), dtype=bool)
            use[1] = len(self._prompt_sizes) > 1  # it says what prompt_token says until two prompt sizes are seen
            use[7] = len(self._draft_sizes) > 1  # the same for draft_step and draft_token
            reg[7, 7] = self.ridge * self._xtx[7, 7]
            coef = np.zeros(len(FEATURES))
            coef[use], *_ = np.linalg.lstsq((self._xtx + reg)[np.ix_(use, use)], self._xty[use], rcond=None)
            self._coef = np.maximum(coef, 0.0)
        return self._coef

    def predict(self, shape: StepShape) -> float:
        return float(self.coefficients() @ shape.features())

    def decode_step_s(self, decodes: int, decode_context: int) -> float:
        """The predicted time of a step of these decodes alone."""
        return self.predict(StepShape(decodes=decodes, decode_context=decode_context))

    def draft_costs_s(self) -> tuple[float, float]:
        """What one proposed token adds to a step, and what a step with proposals pays once (0, 0
        until a step with proposals is seen)."""
        coef = self.coefficients()
        return float(coef[FEATURES.index("draft_token")]), float(coef[FEATURES.index("draft_step")])

    def prompt_tokens_within(
        self, target_s: float, decodes: int, decode_context: int, start: int, draft_tokens: int = 0
    ) -> Optional[int]:
        """The most prompt tokens (a chunk starting after `start` cached tokens) a step beside these
        decodes (verifying `draft_tokens` proposals) can take and still end within `target_s`; never
        below MIN_CHUNK. None: not known yet."""
        if not self.ready:
            return None
        fixed, f, a, c, b, e, g, h = (float(v) for v in self.coefficients())
        room = target_s - (fixed + f + b * decodes + e * decode_context / 1000.0 + g * draft_tokens)
        room -= h if draft_tokens else 0.0
        # a n + (c / 1000) (n start + n^2 / 2) <= room: the positive root of a quadratic in n
        lin = a + c * start / 1000.0
        quad = c / 2000.0
        if room <= 0:
            return MIN_CHUNK
        if quad <= 0:
            n = room / lin if lin > 0 else float("inf")
        else:
            n = (-lin + math.sqrt(lin * lin + 4 * quad * room)) / (2 * quad)
        return MIN_CHUNK if n < MIN_CHUNK else (int(n) if math.isfinite(n) else None)


def prefill_backlog_s(model: StepCostModel, prompts) -> Optional[float]:
    """Seconds of prompt compute still ahead of this engine: `prompts` gives (tokens computed,
    tokens left) per prompt not yet through its prefill. The autoscaler's predicted wait for a
    first token (serving/placement/autoscale_policy.py), from the learned per-token costs; the steps' fixed cost and
    the decodes beside them are left out, so it errs short. None until a prompt's cost is learned."""
    if not model.ready:
        return None
    _, _, a, c, _, _, _, _ = (float(v) for v in model.coefficients())
    return sum(a * left + c * chunk_pairs(done, left) / 1000.0 for done, left in prompts)


@dataclass
class StepTimes:
    """Step durations counted per kind in Prometheus buckets (what /metrics exports per instance)."""

    counts: dict = field(default_factory=lambda: {k: [0] * (len(STEP_BUCKETS) + 1) for k in STEP_KINDS})
    totals: dict = field(default_factory=lambda: {k: 0.0 for k in STEP_KINDS})

    def observe(self, kind: str, seconds: float) -> None:
        self.totals[kind] += seconds
        index = next((i for i, b in enumerate(STEP_BUCKETS) if seconds <= b), len(STEP_BUCKETS))
        self.counts[kind][index] += 1

    def snapshot(self) -> dict:
        """{kind: (bucket bounds, counts per bucket with +Inf last, sum)}, the shape metrics read."""
        return {k: (STEP_BUCKETS, list(self.counts[k]), self.totals[k]) for k in STEP_KINDS}

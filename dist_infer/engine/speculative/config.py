"""How an engine speculates, as one value (`--speculative`, `--num-speculative-tokens`, `--ngram-min`,
`--ngram-max`): checked when it is made, so a bad flag fails before any model loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dist_infer.arg_types import MAX_SPECULATIVE_TOKENS

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` "ngram": prompt lookup (ngram.py), proposals from the request's own history, no
    draft model; "draft": a smaller model of the same vocabulary at `draft_model` (a checkpoint
    directory or GGUF file), run greedily on the instance's driver (draft_model.py). `num_tokens`: the most proposals a step checks per request (K); each request's
    own K adapts to its acceptance (draft_length.py) when `adaptive`. `ngram_min`..`ngram_max`: the
    lengths of the history's tail looked up, longest first."""

    method: str = "ngram"
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = True
    draft_model: Optional[str] = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {METHODS}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("--draft-model goes with --speculative draft, and --speculative draft needs it")
        for name, value, low, high in (
            ("--num-speculative-tokens", self.num_tokens, 1, MAX_SPECULATIVE_TOKENS),
            ("--ngram-min", self.ngram_min, 1, 64),
            ("--ngram-max (at least --ngram-min)", self.ngram_max, self.ngram_min, 64),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")

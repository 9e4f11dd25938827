"""When a step's tokens are split for compute-communication overlap (parallel/token_split.py runs
the split); torch-free so the cost model asks the same rule the engine does."""

from __future__ import annotations

from typing import Optional


def should_split(mode: str, tokens: int, tp_size: int, threshold: Optional[int]) -> bool:
    """Whether a step of `tokens` tokens is split: 'on' whenever possible, 'auto' from `threshold`
    up (None: auto never splits)."""
    if mode not in ("on", "off", "auto"):
        raise ValueError(f"overlap mode must be on, off or auto, got {mode!r}")
    if mode == "off" or tp_size == 1 or tokens < 2:
        return False
    return mode == "on" or (threshold is not None and tokens >= threshold)

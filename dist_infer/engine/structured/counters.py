"""What structured outputs cost one engine, as counters for its metrics (`dist_infer:structured_*`).

Grammar compiles happen on the threads that add requests, masks on the mask filler's thread, the
waits on the sampler's: every add takes a lock. `mask_wait_seconds` is the part of
`mask_seconds` the forward did not hide (the sampler waited for it); 1 - wait / mask is the
share hidden.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class StructuredCounters:
    """Running totals; they only grow."""

    grammar_compiles: int = 0  # specs compiled (a cache miss)
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0  # specs found compiled
    matchers_started: int = 0  # request grammar states made (new, resumed, migrated)
    mask_steps: int = 0  # steps with at least one constrained row
    mask_rows: int = 0  # constrained rows masked
    mask_seconds: float = 0.0  # computing the masks
    mask_wait_seconds: float = 0.0  # the sampler waiting for them
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: float) -> None:
        """Add to the named counters (a name that is not one raises)."""
        with self._lock:
            for name, amount in amounts.items():
                if name not in _NAMES:
                    raise AttributeError(f"no structured-output counter {name!r}")
                setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict:
        """The counters now, as plain data (for the engine's stats)."""
        with self._lock:
            return {name: getattr(self, name) for name in _NAMES}


_NAMES = tuple(f.name for f in fields(StructuredCounters) if not f.name.startswith("_"))

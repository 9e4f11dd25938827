"""What speculation did on one engine, as counters for its metrics (`dist_infer:spec_decode_*`, the
names vLLM uses after its `vllm:` prefix): rounds, proposed and accepted tokens, and accepted
tokens by position (position j: the (j+1)-th proposal of a round was accepted). The driver's step
loop alone adds; a scrape reads a snapshot under the lock."""

from __future__ import annotations

import threading


class SpeculativeCounters:
    def __init__(self, k: int = 0):
        self.num_drafts = 0  # rounds that proposed at least one token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k
        self._lock = threading.Lock()

    def record(self, proposed: int, accepted: int) -> None:
        """One round: `proposed` tokens checked, the first `accepted` of them kept."""
        if proposed <= 0:
            return
        with self._lock:
            self.num_drafts += 1
            self.num_draft_tokens += proposed
            self.num_accepted_tokens += accepted
            if len(self.accepted_per_pos) < proposed:
                self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
            for j in range(accepted):
                self.accepted_per_pos[j] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "num_drafts": self.num_drafts,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
            }

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

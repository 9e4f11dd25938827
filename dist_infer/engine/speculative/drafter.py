"""The scheduler's source of proposals: per request, its token history and its proposal length.

The scheduler asks `propose(request, limit)` for each decode it schedules and the driver tells
`record` what the target accepted; before each step the driver sets `row_cost`, what a proposed
token costs as a share of a plain step's token (engine/step_pacing.py), which each request's
proposal length weighs against its acceptance (draft_length.py). A request's state here is rebuilt from its token ids whenever
they disagree (a new, resumed or migrated request, or one whose history this drafter has not seen):
nothing of it travels with a request, which carries only its ids. Structured-output requests do not
speculate (their grammar would have to follow every proposal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dist_infer.engine.request import Request
from dist_infer.engine.speculative.config import SpeculativeConfig
from dist_infer.engine.speculative.counters import SpeculativeCounters
from dist_infer.engine.speculative.draft_length import DraftLength
from dist_infer.engine.speculative.ngram import TokenHistory


class Drafter(Protocol):
    """What the scheduler asks for proposals, and the driver tells what came of them."""

    row_cost: float  # what a proposed token costs, as a share of a plain step's token (set per step)
    step_cost: float  # what a step with proposals pays once, the same way

    def prepare(self, requests) -> None: ...

    def propose(self, request: Request, limit: int) -> list[int]: ...

    def record(self, request: Request, proposed: int, accepted: int) -> None: ...

    def forget(self, request: Request) -> None: ...


@dataclass
class _RequestDrafts:
    history: TokenHistory
    length: DraftLength


class NgramDrafter:
    """Prompt-lookup proposals (ngram.py) with an adaptive length per request (draft_length.py),
    never past the model's `max_positions`; `counters` get every round's outcome."""

    def __init__(self, config: SpeculativeConfig, max_positions: int, counters: SpeculativeCounters):
        self.config, self.max_positions, self.counters = config, max_positions, counters
        self._requests: dict[str, _RequestDrafts] = {}
        self.row_cost = self.step_cost = 0.0  # set by the driver before each step
        self._ready: dict[str, tuple[int, list[int]]] = {}  # request -> (its tokens when proposed, proposals)

    def _state(self, request: Request) -> _RequestDrafts:
        """`request`'s history, caught up with its ids (rebuilt if it is not a prefix of them)."""
        state = self._requests.get(request.request_id)
        prompt = len(request.prompt_token_ids)
        if state is None or not prompt <= len(state.history) <= request.num_tokens:
            state = _RequestDrafts(
                TokenHistory(request.all_token_ids), DraftLength(self.config.num_tokens, self.config.adaptive)
            )
            self._requests[request.request_id] = state
        elif len(state.history) < request.num_tokens:
            state.history.extend(request.output_token_ids[len(state.history) - prompt :])
        return state

    def prepare(self, requests) -> None:
        """Before a step: the proposals of every decode among `requests` that may speculate, kept
        only if their expected gains together beat what a step with proposals pays (`step_cost`)."""
        made = {}
        for r in requests:
            if self._ready.get(r.request_id, (-1, None))[0] == r.num_tokens:
                continue  # proposed at this length already (pp: a step before this one left it out)
            if not r.in_flight and r.num_tokens - r.num_computed == 1:
                room = r.params.max_new_tokens - len(r.output_token_ids) - 1
                made[r.request_id] = (r, self._lookup(r, room))
        gain = sum(self._requests[rid].length.expected_gain(len(p), self.row_cost) for rid, (_, p) in made.items() if p)
        keep = gain > self.step_cost
        for rid, (r, proposals) in made.items():
            self._ready[rid] = (r.num_tokens, proposals if keep else [])

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to `limit` tokens to check after `request`'s last one ([] to decode plainly): what
        `prepare` made for it at its current length, else a look-up now."""
        at, proposals = self._ready.pop(request.request_id, (-1, None))
        if proposals is None or at != request.num_tokens:
            proposals = self._lookup(request, limit)
        return proposals[: max(0, limit)]

    def _lookup(self, request: Request, limit: int) -> list[int]:
        """Up to `limit` tokens from the request's history, as many as its proposal length says."""
        if request.grammar is not None or request.params.structured is not None:
            return []
        limit = min(limit, self.max_positions - request.num_tokens)
        if limit <= 0:
            return []
        state = self._state(request)
        k = min(state.length.next(self.row_cost), limit)
        if k <= 0:
            return []
        c = self.config
        return state.history.propose(k, c.ngram_min, c.ngram_max)

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        """The target accepted the first `accepted` of `proposed` tokens of `request`'s round."""
        self.counters.record(proposed, accepted)
        state = self._requests.get(request.request_id)
        if state is not None:
            state.length.record(proposed, accepted)

    def forget(self, request: Request) -> None:
        """`request` ended or left this instance."""
        self._requests.pop(request.request_id, None)
        self._ready.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

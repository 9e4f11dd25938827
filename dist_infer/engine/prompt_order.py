"""Which prompt the scheduler gives its token budget to first (`--scheduling-policy`).

fcfs: arrival order, vLLM's default. shortest-prompt: the prompt with the fewest tokens left to
compute first (shortest remaining processing time), a partly computed long prompt yielding its next
chunk to a short one that arrived after it. Under a lognormal mix of prompt lengths (chat traces:
most short, a long tail) one long prompt in chunks otherwise holds every short one behind it, and
the median first token waits for the tail; SRPT minimises the mean wait of a single queue
(docs/benchmarks.md, "Against vLLM's CPU backend"). So that no prompt starves, one that has waited
`max_wait_s` since it arrived goes before every unaged one, aged ones in arrival order. A request
failed over from a dead instance or preempted here goes first under either policy: its client is
mid-stream; failed-over tails go few at a time, the fewest tokens first (`recovery_tails`). Pure
functions of the requests and the clock: the tests drive them directly.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Optional

from dist_infer.arg_types import DEFAULT_PROMPT_MAX_WAIT_S, SCHEDULING_POLICIES

if TYPE_CHECKING:
    from dist_infer.engine.request import Request

RECOVERY_STEP_ROWS = 8  # failed-over tails past the first share a step up to this many rows (recovery_tails)


def recovery_tails(running: list[Request]) -> tuple[dict[int, int], int]:
    """Of the running requests failed over here (resumed, their mirrored KV taken over), those whose
    tails the next step computes again ({id: order}, fewest tokens left first) and the tokens they
    add: the first whole, the others while the total stays within RECOVERY_STEP_ROWS. Each client
    waits for the tails before its own, so the shortest first waits least; a step's cost is the sum
    of its rows' on a compute-bound CPU, so a long-context tail of a few rows in one step with others'
    waited for all of them (docs/benchmarks.md, "KV mirroring")."""
    resumed = sorted((r for r in running if r.resumed and not r.in_flight), key=lambda r: r.num_tokens - r.num_computed)
    carried: dict[int, int] = {}
    rows = 0
    for r in resumed:
        left = r.num_tokens - r.num_computed
        if carried and rows + left > RECOVERY_STEP_ROWS:
            break
        carried[id(r)], rows = len(carried), rows + left
    return carried, rows


def check_policy(policy: str, max_wait_s: float) -> None:
    """Raise a ValueError naming the setting that is not a policy or not a positive wait."""
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling policy {policy!r} is not one of {SCHEDULING_POLICIES}")
    if not max_wait_s > 0:
        raise ValueError(f"the shortest-prompt policy's max wait must be positive seconds, got {max_wait_s}")


def mid_stream(request: Request) -> bool:
    """Failed over or preempted: its client already saw tokens (or waited its turn once)."""
    return request.resumed or request.num_preemptions > 0


def prompt_key(request: Request, policy: str, now: float, max_wait_s: float) -> tuple:
    """Sort key of a prompt (waiting, or running with more than one token left): lower goes first."""
    if mid_stream(request):
        return (0, 0, request.arrival_time)
    if policy == "fcfs" or now - request.arrival_time >= max_wait_s:
        return (1, 0, request.arrival_time)
    return (2, request.num_tokens - request.num_computed, request.arrival_time)


class PromptOrder:
    """A scheduler's prompt policy and the clock prompts' waits are read on (Request.arrival_time's),
    read once a step (`start_step`) so that one step's keys agree."""

    def __init__(
        self,
        policy: str = "fcfs",
        max_wait_s: float = DEFAULT_PROMPT_MAX_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        check_policy(policy, max_wait_s)
        self.policy, self.max_wait_s, self.clock = policy, max_wait_s, clock
        self.now = clock()

    def key(self, request: Request) -> tuple:
        return prompt_key(request, self.policy, self.now, self.max_wait_s)

    def start_step(self, waiting: deque) -> Optional[tuple]:
        """Read the clock; under shortest-prompt sort `waiting` in place and return its first prompt's
        key (a running prompt with a greater one yields its chunk to it); None under fcfs or if empty."""
        self.now = self.clock()
        if self.policy == "fcfs" or not waiting:
            return None
        ordered = sorted(waiting, key=self.key)
        waiting.clear()
        waiting.extend(ordered)
        return self.key(waiting[0])

    def running_prompts(self, running: list[Request]) -> list[Request]:
        """Running requests in the order their prompts' chunks take the budget (fcfs: admission order)."""
        return running if self.policy == "fcfs" else sorted(running, key=self.key)

    def first(self, prompts: list[Request], waiting: deque) -> Optional[Request]:
        """Of running `prompts` (in admission order) and the sorted `waiting`, the prompt the step serves first."""
        if self.policy != "fcfs":
            prompts = sorted(prompts + list(waiting)[:1], key=self.key)
        return next(iter(prompts), waiting[0] if waiting else None)

"""Intake: the driver's live requests, and the command queue that hands new ones to the step loop.

Other threads (the serving layer's) never touch the scheduler: they queue commands (add, abort,
call), which the step loop takes before its next step. The registry (live requests by id) is what
the loop steps, what migration finds and adopts, and what the stats count; it numbers each
request it registers with the sequence id the plans and the workers know it by.
"""

from __future__ import annotations

import queue
import secrets
import threading
from typing import Callable, Iterator, Optional

from dist_infer.engine.request import PromptError, Request, check_prompt
from dist_infer.engine.sampling import SamplingParams


class RequestRegistry:
    """The driver's requests: the commands queued for the step loop (thread-safe), the wake-up
    of an idle loop, and the live requests by id with their sequence numbering (the loop's thread)."""

    def __init__(self):
        self._commands: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._live: dict[str, Request] = {}
        self._next_seq = 0
        self.requests_added = 0  # add commands applied (the API counts what it sent and has not been seen)

    # -- commands (any thread) ----------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue a request; it joins the batch at the next step."""
        self._commands.put(("add", request))
        self._wakeup.set()
        return request

    def abort(self, request_id: str) -> None:
        """Queue the end of a request wherever it is (idempotent)."""
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Queue `fn` to run on the step loop's thread before the next step."""
        self._commands.put(("call", fn))
        self._wakeup.set()

    def wake(self) -> None:
        """Cut an idle loop's wait short."""
        self._wakeup.set()

    def wait(self, timeout: float) -> None:
        """The idle loop: sleep until a command (or a wake) or `timeout` seconds."""
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def has_unfinished(self) -> bool:
        return bool(self._live) or not self._commands.empty()

    # -- the loop's thread ----------------------------------------------------------------------
    def take_commands(self) -> Iterator[tuple[str, object]]:
        """Each queued command, (kind, argument), until the queue is empty (those queued while
        one is applied included)."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def count_added(self) -> None:
        """An add applied, or refused (the API's pending count goes by both)."""
        self.requests_added += 1

    def register(self, request: Request) -> None:
        """A request now live here: numbered with the next sequence id."""
        request.seq_id = self._next_seq
        self._next_seq += 1
        self._live[request.request_id] = request

    def find(self, request_id: str) -> Optional[Request]:
        return self._live.get(request_id)

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)


def check_servable(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_positions: int,
    scheduler,
    name: str = "prompt",
) -> None:
    """Raise RequestError naming the field if the model, or the cache (`scheduler`; None: not sized
    yet), can never serve this request."""
    check_prompt(prompt_token_ids, params, vocab_size, max_positions, name)
    if scheduler is not None:
        why = scheduler.check_fits(len(prompt_token_ids), params.max_new_tokens)
        if why:
            raise PromptError(f"{name}: {why}", field="max_tokens")


def new_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
    """A request of these tokens, with the params' seed or a fresh random one."""
    seed = params.seed if params.seed is not None else secrets.randbits(52)
    return Request(request_id, list(prompt_token_ids), params, seed)


def resume(r: Request, progress, now: float) -> Request:
    """`r` going on from the tokens its client already has (its instance died): they are prefilled
    again with the prompt, and only what is new is reported. `progress` is a
    serving/fleet/wire.ResumeProgress (token_ids, logprobs, top_logprobs reported so far; age_s,
    first_token_age_s); `now`: time.monotonic(). With the same seed (sampling draws from (seed,
    position)) it continues exactly as it would have."""
    tokens = list(progress.token_ids)
    r.output_token_ids, r.output_logprobs = tokens, list(progress.logprobs)
    r.output_top_logprobs = [[tuple(x) for x in row] for row in progress.top_logprobs]
    r.emitted_tokens, r.resumed = len(tokens), True
    r.arrival_time = now - progress.age_s
    if tokens and progress.first_token_age_s is not None:
        r.first_token_time = now - progress.first_token_age_s
    return r

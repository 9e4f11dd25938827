"""A request's life in the engine, and what the engine reports about it after each step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from dist_infer.engine.layered_prefill import LayerProgress
from dist_infer.engine.request_error import RequestError
from dist_infer.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from dist_infer.engine.structured.matcher import RequestMatcher


class PromptError(RequestError):
    """A prompt the model cannot take (empty, too long, ids outside the vocabulary)."""

    def __init__(self, message: str, field: str = "prompt"):
        super().__init__(field, message)


def check_prompt(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_positions: int, name: str = "prompt"
) -> None:
    """Raise PromptError naming the field if no instance of this model could ever serve the request."""
    if not prompt_token_ids:
        raise PromptError(f"{name} is empty")
    total = len(prompt_token_ids) + params.max_new_tokens  # before the scan: a huge prompt costs nothing
    if total > max_positions:
        raise PromptError(
            f"{name} has {len(prompt_token_ids)} tokens + {params.max_new_tokens} new tokens = "
            f"{total}, more than the model's {max_positions} positions",
            field="max_tokens",
        )
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise PromptError(f"{name} has token ids {bad[:5]} outside the vocabulary of {vocab_size}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again (its KV blocks freed)
    RUNNING = "running"  # holds KV blocks; gets prefill chunks, then one token per step
    MIGRATING = "migrating"  # paused while it moves to another instance; keeps its blocks until it has
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One prompt being served. `all_token_ids` = prompt + generated; `num_computed` of them
    have their keys and values in the cache (and, during a step, have been scheduled). Equal only
    to itself: the scheduler's list look-ups then cost an identity test, not a field-by-field compare."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed in use (params.seed, or one the engine drew)
    seq_id: int = 0  # a small integer naming the sequence in step plans (unique while it lives)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    in_flight: bool = False  # a step that samples its next token is on the way (pipeline)
    finish_reason: Optional[str] = None  # "stop", "length", "abort"
    stop_reason: Optional[object] = None  # the stop string or token id that ended it
    num_preemptions: int = 0
    first_token_time: Optional[float] = None
    emitted_tokens: int = 0  # tokens already reported
    resumed: bool = False  # it goes on from another instance's tokens (its instance died), until its first step
    logits: list = field(default_factory=list)  # per generated token, when the caller asked for them
    # prefix caching (prefix_cache.py): the hashes of its full blocks so far (its tokens only grow, so
    # they hold across preemption), how many leading blocks of its table are cached (shared or
    # registered), and whether its computed blocks may be registered (not those a migration brought)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    cacheable: bool = True
    layer_progress: Optional[LayerProgress] = None  # in the middle of a layered prefill (layered_prefill.py)
    # structured outputs: its grammar state after its output ids (engine/structured/matcher.py), the
    # driver's own; made when the request is added or adopted, never sent anywhere (rebuilt from the ids)
    grammar: Optional["RequestMatcher"] = field(default=None, repr=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def computed_prompt(self) -> int:
        """How many of its prompt tokens steps have computed."""
        return min(self.num_computed, len(self.prompt_token_ids))

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class RequestOutput:
    """What one step (or the end) added to a request: new tokens since the last report."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[list[tuple[int, float]]]  # per new token: (id, logprob) best first; [] if not asked
    text_delta: str  # new text: '' from the engine, filled in by the front end's detokenizer
    finished: bool
    finish_reason: Optional[str] = None  # "stop" (EOS, stop id or stop string), "length", "abort"
    stop_reason: Optional[object] = None  # the stop string or id, None for EOS/length
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # in total so far
    error: Optional[str] = None  # set when the request ended because the engine failed
    error_status: int = 500  # with error: 400 when the request itself was refused, 500 when a step failed it

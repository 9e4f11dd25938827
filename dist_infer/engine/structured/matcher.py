"""A request's grammar state.

The state is a function of the request's output ids alone: a request preempted (recomputed),
resumed on another instance after a failure or migrated there rebuilds it by feeding the grammar
the ids it already has, so nothing but the spec travels with a request. The driver owns each
state: a row's mask is filled (mask_filler.py) for a step that samples the request (a request
is in one step at a time, so the state is the one that step samples from), and the driver
advances the state with the token that comes back.
"""

from __future__ import annotations

from typing import Iterable

import torch

from dist_infer.engine.structured.token_mask import mask_words


class GrammarRejected(RuntimeError):
    """A token the request's grammar does not allow (a sampler that ignored the mask, or output
    ids from elsewhere that do not fit the spec)."""


class RequestMatcher:
    """One request's position in its grammar (llguidance's LLMatcher `matcher`, over a tokenizer
    of `vocab_size` ids)."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self.vocab_size = matcher, vocab_size
        self.words = mask_words(vocab_size)

    @classmethod
    def start(cls, tokenizer, grammar: str, limits, token_ids: Iterable[int] = ()) -> "RequestMatcher":
        """The state at the start of `grammar` (checked already) over the LLTokenizer `tokenizer`
        under LLParserLimits `limits`, after `token_ids` (the output so far); GrammarRejected
        if they do not fit it."""
        from llguidance import LLMatcher

        return cls.resume(LLMatcher(tokenizer, grammar, log_level=0, limits=limits), tokenizer.vocab_size, token_ids)

    @classmethod
    def resume(cls, matcher, vocab_size: int, token_ids: Iterable[int] = ()) -> "RequestMatcher":
        """The state of llguidance's `matcher` (at its grammar's start, ours alone) after `token_ids`."""
        state = cls(matcher, vocab_size)
        state._check("starting the grammar")
        ids = [int(t) for t in token_ids]
        if ids and not state._matcher.consume_tokens(ids):
            raise GrammarRejected(f"the output so far ({len(ids)} tokens) does not fit the grammar: {state._error()}")
        return state

    def _error(self) -> str:
        return self._matcher.get_error().replace("<non-verbose/>", "").strip()

    def _check(self, what: str) -> None:
        if self._matcher.is_error():
            raise GrammarRejected(f"{what}: {self._error()}")

    def advance(self, token: int) -> bool:
        """Feed the sampled `token`; True once the grammar is finished (nothing more may follow).
        GrammarRejected if the grammar does not allow it."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarRejected(f"token {int(token)} is not allowed by the grammar: {self._error()}")
        return self._matcher.is_stopped()

    def is_finished(self) -> bool:
        """The grammar is complete and nothing more may follow (EOS aside)."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may also go on)."""
        return self._matcher.is_accepting()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` ([R, words] int32, host, contiguous)."""
        _check_bitmask(bitmask, self.words)
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), self.words * 4)

    def llmatcher(self):
        """llguidance's matcher (for the executor's parallel fill)."""
        return self._matcher


def _check_bitmask(bitmask: torch.Tensor, words: int) -> None:
    """llguidance writes through a raw pointer: anything but this shape would corrupt memory."""
    if not (
        bitmask.dtype == torch.int32
        and bitmask.device.type == "cpu"
        and bitmask.dim() == 2
        and bitmask.shape[1] == words
        and bitmask.is_contiguous()
    ):
        raise ValueError(f"a mask must be a contiguous host int32 [rows, {words}] tensor, got {bitmask.shape}")

"""What a sampled token does to its request: append it, check the stops, report.

The engine deals in token ids only: EOS, stop token ids, a finished grammar (structured outputs)
and the length end a request here; the text and the stop strings are the front end's
(serving/http/detokenizer.py), which aborts a request whose stop string it sees, so a request moved
to another instance carries no text state.
"""

from __future__ import annotations

from typing import Optional

from dist_infer.engine.intake import RequestRegistry
from dist_infer.engine.request import Request, RequestOutput
from dist_infer.engine.sampling import SampledTokens
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.step_guard import failed_output


def delta_output(r: Request) -> RequestOutput:
    """`r`'s new tokens since its last report (which this one becomes)."""
    k = r.emitted_tokens
    out = RequestOutput(
        request_id=r.request_id,
        new_token_ids=r.output_token_ids[k:],
        new_logprobs=r.output_logprobs[k:],
        new_top_logprobs=r.output_top_logprobs[k:] if r.params.logprobs else [],
        text_delta="",
        finished=r.finished,
        finish_reason=r.finish_reason,
        stop_reason=r.stop_reason,
        num_prompt_tokens=len(r.prompt_token_ids),
        num_generated_tokens=len(r.output_token_ids),
    )
    r.emitted_tokens = len(r.output_token_ids)
    return out


class RequestProgress:
    """Driver: a step's rows to their requests, and ending requests: the scheduler frees their
    blocks, the registry forgets them. `eos_token_ids` and `max_positions` are the model's."""

    def __init__(self, scheduler: Scheduler, registry: RequestRegistry, eos_token_ids, max_positions: int):
        self.scheduler, self.registry = scheduler, registry
        self.eos_token_ids, self.max_positions = eos_token_ids, max_positions

    def take_token(self, r: Request, sampled: SampledTokens, i: int, return_logits: bool, now: float) -> RequestOutput:
        """Row `i` of a step's tokens to its request: append it, check the stops, report. A
        request with a grammar feeds it the token first (GrammarRejected if it does not fit: the
        caller fails the request) and ends with "stop" once the grammar is finished."""
        reason = self._append(r, sampled, i, return_logits, now)
        return self.finish(r, reason) if reason is not None else delta_output(r)

    def take_tokens(
        self, r: Request, sampled: SampledTokens, first: int, accepted: int, return_logits: bool, now: float
    ) -> RequestOutput:
        """A speculating row: rows first .. first + accepted of the step's tokens (the accepted
        proposals, then the target's own token) to `r`, one at a time, each checked for the stops
        as a plain step's is, so a stop inside the run ends it there; one report for them all. Each
        accepted proposal's KV counts as computed as it is appended (scheduler.accept_proposed)."""
        for j in range(accepted + 1):
            reason = self._append(r, sampled, first + j, return_logits, now)
            if reason is not None:
                return self.finish(r, reason)
            if j < accepted:
                self.scheduler.accept_proposed(r)
        self.scheduler.release_unverified(r)
        return delta_output(r)

    def _append(self, r: Request, sampled: SampledTokens, i: int, return_logits: bool, now: float) -> Optional[str]:
        """Row `i`'s token appended to `r` (with its logprobs and logits); why `r` ends now, or None."""
        self.scheduler.on_sampled(r)
        token = int(sampled.tokens[i])
        grammar_done = r.grammar is not None and r.grammar.advance(token)
        r.output_token_ids.append(token)
        r.output_logprobs.append(float(sampled.logprobs[i]))
        if r.params.logprobs:
            k = r.params.logprobs
            r.output_top_logprobs.append(
                list(zip(sampled.top_ids[i, :k].tolist(), sampled.top_logprobs[i, :k].tolist()))
            )
        if return_logits:
            r.logits.append(sampled.logits[i].clone())
        if r.first_token_time is None:
            r.first_token_time = now
        reason = self.stop_reason(r)
        if grammar_done and reason != "stop":
            reason = "stop"  # the output is complete: nothing more could follow it
        return reason

    def stop_reason(self, r: Request) -> Optional[str]:
        """Why `r` ends after its newest token, or None. EOS cannot come before min_tokens (the
        sampler bans it); a stop token id does not count before it either."""
        p, token, n = r.params, r.output_token_ids[-1], len(r.output_token_ids)
        if n >= p.min_tokens:
            if p.stop_at_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_set:
                r.stop_reason = token
                return "stop"
        if n >= p.max_new_tokens or r.num_tokens >= self.max_positions:
            return "length"
        return None

    def finish(self, r: Request, reason: str) -> RequestOutput:
        """End `r` (its blocks freed, forgotten here) and report what it has not yet."""
        self.scheduler.finish(r, reason)
        self.registry.forget(r.request_id)
        return delta_output(r)

    def fail(self, r: Request, message: str) -> RequestOutput:
        """End a request with an error (an abort): its blocks are freed, and the next plan tells
        the followers, as for a client's abort."""
        r.finish_reason = "abort"
        self.scheduler.finish(r, "abort")
        self.registry.forget(r.request_id)
        return failed_output(r, message)

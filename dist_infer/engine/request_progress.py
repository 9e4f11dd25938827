"""What a sampled token does to its request: append it, check the stops, detokenize, report.

The driver decodes the whole output again on each token (issue 31 moves detokenizing to the
front end); stop strings are searched only in the text new since the last token.
"""

from __future__ import annotations

from typing import Optional

from dist_infer.engine.request import Request, RequestOutput
from dist_infer.engine.sampling import SampledTokens
from dist_infer.engine.step_guard import failed_output


class RequestProgress:
    """Engine mixin, driver only: a step's rows to their requests, and ending requests.
    Uses the engine's scheduler, tokenizer, cfg and `_requests`."""

    def _take_token(self, r: Request, sampled: SampledTokens, i: int, return_logits: bool, now: float) -> RequestOutput:
        """Row `i` of a step's tokens to its request: append it, check the stops, report."""
        self.scheduler.on_sampled(r)
        token = int(sampled.tokens[i])
        r.output_token_ids.append(token)
        r.output_logprobs.append(float(sampled.logprobs[i]))
        if r.params.logprobs:
            k = r.params.logprobs
            r.output_top_logprobs.append(list(zip(sampled.top_ids[i, :k].tolist(), sampled.top_logprobs[i, :k].tolist())))
        if return_logits:
            r.logits.append(sampled.logits[i].clone())
        if r.first_token_time is None:
            r.first_token_time = now
        reason = self._stop_reason(r)
        return self._finish(r, reason) if reason is not None else self._delta(r)

    def _stop_reason(self, r: Request) -> Optional[str]:
        """Why `r` ends after its newest token, or None. Stop strings are looked for only in text
        that is new since the last token (plus the length of a stop string, for one that spans
        tokens), and only from min_tokens on; EOS cannot come before min_tokens (the sampler bans it)."""
        p, token, n = r.params, r.output_token_ids[-1], len(r.output_token_ids)
        before = len(r.text)
        if self.tokenizer is not None:
            r.text = self.tokenizer.decode(r.output_token_ids)
        if n >= p.min_tokens:
            if p.stop_at_eos and token in self.cfg.eos_token_ids:
                return "stop"
            if token in p.stop_token_set:
                r.stop_reason = token
                return "stop"
            if p.stop and self.tokenizer is not None:
                longest = max(len(s) for s in p.stop)
                start = max(0, before - longest + 1, r.stop_search_from)
                hits = [(r.text.find(s, start), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    at, s = min(hits)
                    r.text, r.stop_reason = r.text[:at], s
                    return "stop"
        elif n == p.min_tokens - 1:
            r.stop_search_from = len(r.text)  # text before min_tokens can never hold the stop
        if n >= p.max_new_tokens or r.num_tokens >= self.cfg.max_positions:
            return "length"
        return None

    def _delta(self, r: Request) -> RequestOutput:
        """New tokens and text since the last report. Text that could be the start of a stop
        string, or an incomplete character, is held back until it is certain."""
        text_end = len(r.text)
        if not r.finished:
            if r.params.stop:
                text_end = max(r.emitted_text, text_end - (max(len(s) for s in r.params.stop) - 1))
            while text_end > r.emitted_text and r.text[text_end - 1] == "\ufffd":
                text_end -= 1
        k = r.emitted_tokens
        out = RequestOutput(
            request_id=r.request_id, new_token_ids=r.output_token_ids[k:], new_logprobs=r.output_logprobs[k:],
            new_top_logprobs=r.output_top_logprobs[k:] if r.params.logprobs else [],
            text_delta=r.text[r.emitted_text:text_end], finished=r.finished, finish_reason=r.finish_reason,
            stop_reason=r.stop_reason, num_prompt_tokens=len(r.prompt_token_ids),
            num_generated_tokens=len(r.output_token_ids))
        r.emitted_tokens, r.emitted_text = len(r.output_token_ids), text_end
        return out

    def _finish(self, r: Request, reason: str) -> RequestOutput:
        self.scheduler.finish(r, reason)
        self._requests.pop(r.request_id, None)
        return self._delta(r)

    def _fail(self, r: Request, message: str) -> RequestOutput:
        """End a request with an error (an abort): its blocks are freed, and the next plan tells
        the followers, as for a client's abort."""
        r.finish_reason = "abort"
        self.scheduler.finish(r, "abort")
        self._requests.pop(r.request_id, None)
        return failed_output(r, message)

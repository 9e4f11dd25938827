"""Token ids to text in the front end, as they arrive: constant work per token, stop strings too.

The engine reports token ids only; the text, and the stop strings that need it, are the front
end's. So a migrated, handed-over or failed-over request carries no text state: the same
detokenizer goes on reading the ids, whichever instance sends them.

Decoding the whole output again on every token costs a time linear in the output's length per
token. Like vLLM's incremental detokenizer (and TGI's `decode_token`), this decodes a short
window instead: the tokens from the last character boundary that was emitted (`_prefix`) on. The
text the newest tokens add is taken once it ends in a whole character, so a character split over
byte tokens is never sent in halves. Stop strings are searched only in the new text plus the
longest stop string's length less one (for one that spans tokens), and text that could be the
start of a stop string is held back until it is certain.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Protocol

from dist_infer.engine.request import RequestOutput

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence
MAX_PENDING_TOKENS = 8  # a window that still ends incomplete after this many tokens is invalid UTF-8: emit it


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """One request's output text, built token by token (its own ids only, not the prompt's).

    `text` is the text of the tokens so far, up to the last whole character; `stop` the stop
    string that ended it (the text is cut where it starts), or None."""

    def __init__(self, decoder: Decoder, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self._decode = decoder.decode
        self._stops = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._min_tokens = min_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: the tokens before it are final text
        self._read = 0  # tokens up to here are in `text`
        self._search_from = 0  # stop strings start at or after this character (none before min_tokens)
        self._emitted = 0  # characters of `text` already given out
        self.text = ""
        self.stop: Optional[str] = None

    def add(self, token: int) -> bool:
        """Take one token; True if a stop string ends the output with it."""
        if self.stop is not None:
            raise ValueError("a token after the stop string")
        before = len(self.text)
        self._ids.append(int(token))
        self._advance(force=False)
        n = len(self._ids)
        if n >= self._min_tokens:
            if self._stops:
                return self._find_stop(max(0, before - self._hold, self._search_from))
        elif n == self._min_tokens - 1:
            self._search_from = len(self.text)  # text before min_tokens can never hold the stop
        return False

    def finish(self) -> None:
        """The output ended (EOS, a stop id, its length, an abort): decode what is pending."""
        if self.stop is None and self._read < len(self._ids):
            before = len(self.text)
            self._advance(force=True)
            if len(self._ids) >= self._min_tokens and self._stops:
                self._find_stop(max(0, before - self._hold, self._search_from))

    def take(self, final: bool) -> str:
        """The text not given out yet that is certain: all of it when the output has ended,
        otherwise all but what could still become the start of a stop string."""
        end = len(self.text)
        if not final and self.stop is None:
            end = max(self._emitted, end - self._hold)
        out, self._emitted = self.text[self._emitted : end], end
        return out

    def _advance(self, force: bool) -> None:
        """Move the window's new text into `text` once it ends in a whole character."""
        prefix = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        pending = len(self._ids) - self._read
        if len(window) > len(prefix) and (force or not window.endswith(REPLACEMENT) or pending >= MAX_PENDING_TOKENS):
            self.text += window[len(prefix) :]
            self._prefix, self._read = self._read, len(self._ids)
        elif force:
            self._read = len(self._ids)

    def _find_stop(self, start: int) -> bool:
        hits = [(at, s) for s in self._stops if (at := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, self.stop = min(hits)
        self.text = self.text[:at]
        self._emitted = min(self._emitted, at)
        return True


def detokenize_output(detok: IncrementalDetokenizer, out: RequestOutput) -> RequestOutput:
    """`out` with its text: the new tokens read one by one; if a stop string ends the output
    within them, the tokens after the one that completed it are dropped and the output is
    finished there ("stop", the string as its stop_reason), as the engine would have ended it."""
    if out.error:
        return out
    tokens = out.new_token_ids
    for k, token in enumerate(tokens):
        if detok.add(token):
            cut = len(tokens) - (k + 1)
            return replace(
                out,
                new_token_ids=tokens[: k + 1],
                new_logprobs=out.new_logprobs[: k + 1],
                new_top_logprobs=out.new_top_logprobs[: k + 1],
                text_delta=detok.take(final=True),
                finished=True,
                finish_reason="stop",
                stop_reason=detok.stop,
                num_generated_tokens=out.num_generated_tokens - cut,
            )
    if out.finished:
        detok.finish()
        if detok.stop is not None:  # the final flush completed a stop string
            return replace(out, text_delta=detok.take(final=True), finish_reason="stop", stop_reason=detok.stop)
    return replace(out, text_delta=detok.take(final=out.finished))

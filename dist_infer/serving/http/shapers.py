"""Engine deltas shaped as OpenAI's completion and chat objects (with vLLM's token-id fields).

The two endpoints share one skeleton, written once in ResponseShaper: a streamed chunk and a
whole response are `head` + one choice (index, the text, logprobs, finish and stop reason, the
token ids) + the usage; a whole response's logprobs are its deltas' logprobs joined. A subclass
gives only what differs: its object names, how the text sits in a choice (`text_fields`), one
delta's logprobs (`delta_logprobs`), where the prompt's token ids go (in the first choice for
completions, in the first chunk for chat: `prompt_ids_in_choice`), the fields only a whole
response's choice has (`final_choice_extras`) and any chunks a stream opens with.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import TYPE_CHECKING, Any, Optional

from dist_infer.engine.request import RequestOutput
from dist_infer.serving.http.tool_call_parsing import ToolCall, ToolCallDelta, ToolCallStream
from dist_infer.serving.http.tools import ToolPlan

if TYPE_CHECKING:
    from dist_infer.serving.http.state import ServingState

MIN_LOGPROB = -9999.0  # what -inf becomes (JSON has no infinities), as vLLM does


def _logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


class ResponseShaper:
    """Turns deltas into one endpoint's OpenAI objects; counts what was sent for the usage."""

    object_name = ""
    chunk_object_name = ""
    prompt_ids_in_choice = False  # the prompt's ids in the (first) choice, else in the (first) chunk
    final_choice_extras: dict[str, Any] = {}  # fields only a whole response's choice has (before token_ids)

    def __init__(self, state: "ServingState", request_id: str, prompt_ids: list[int], num_logprobs: Optional[int]):
        self.state = state
        self.request_id = request_id
        self.created = int(time.time())
        self.prompt_ids = prompt_ids
        self.num_logprobs = num_logprobs
        self.num_generated = 0
        self.first_chunk = True

    # -- what a subclass gives ---------------------------------------------------------------------
    def text_fields(self, text: str, final: bool) -> dict:
        """The choice's text: a chunk's delta (final False) or the whole response's (final True)."""
        raise NotImplementedError

    def delta_logprobs(self, out: RequestOutput) -> dict:
        """One delta's logprobs: a dict of lists (a whole response's joins its deltas' key by key)."""
        raise NotImplementedError

    def opening_chunks(self) -> list[dict]:
        return []

    # -- the skeleton ------------------------------------------------------------------------------
    def head(self, object_name: str) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.state.served_name}

    def usage(self) -> dict:
        n = len(self.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": self.num_generated, "total_tokens": n + self.num_generated}

    def usage_chunk(self) -> dict:
        return {**self.head(self.chunk_object_name), "choices": [], "usage": self.usage()}

    def prompt_ids_once(self) -> Optional[list[int]]:
        """The prompt's ids in the stream's first chunk, None after."""
        ids = self.prompt_ids if self.first_chunk else None
        self.first_chunk = False
        return ids

    def top_dict(self, entries: list[tuple[int, float]]) -> dict[str, float]:
        """token text -> logprob; two ids with the same text keep both (the second as token_id:N)."""
        out: dict[str, float] = {}
        for token_id, lp in entries:
            key = self.state.token_text(token_id)
            out[key if key not in out else f"token_id:{token_id}"] = _logprob(lp)
        return out

    def logprobs(self, out: RequestOutput) -> Optional[dict]:
        return None if self.num_logprobs is None else self.delta_logprobs(out)

    def choice(
        self,
        text: str,
        logprobs: Optional[dict],
        finish_reason: Optional[str],
        stop_reason: Any,
        token_ids: list[int],
        final: bool,
    ) -> dict:
        choice = {
            "index": 0,
            **self.text_fields(text, final),
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            **(self.final_choice_extras if final else {}),
            "token_ids": token_ids,
        }
        if self.prompt_ids_in_choice:
            choice["prompt_token_ids"] = self.prompt_ids if final else self.prompt_ids_once()
        return choice

    def chunk(self, out: RequestOutput, include_usage: bool, continuous_usage: bool) -> Optional[dict]:
        """One delta as a stream's chunk; None for a delta with nothing to send."""
        if not out.new_token_ids and not out.text_delta and not out.finished:
            return None
        self.num_generated += len(out.new_token_ids)
        choice = self.choice(
            out.text_delta,
            self.logprobs(out),
            out.finish_reason if out.finished else None,
            out.stop_reason if out.finished else None,
            list(out.new_token_ids),
            final=False,
        )
        chunk = {**self.head(self.chunk_object_name), "choices": [choice]}
        if not self.prompt_ids_in_choice:
            chunk["prompt_token_ids"] = self.prompt_ids_once()
        if include_usage:
            chunk["usage"] = self.usage() if continuous_usage else None
        return chunk

    def response(self, outputs: list[RequestOutput]) -> dict:
        """All of a request's deltas as one (non-streamed) response."""
        ids = [t for o in outputs for t in o.new_token_ids]
        self.num_generated = len(ids)
        last = outputs[-1]
        logprobs = None
        if self.num_logprobs is not None:
            parts = [self.delta_logprobs(o) for o in outputs]
            logprobs = {key: [v for p in parts for v in p[key]] for key in parts[0]}
        choice = self.choice(
            "".join(o.text_delta for o in outputs), logprobs, last.finish_reason, last.stop_reason, ids, final=True
        )
        return {
            **self.head(self.object_name),
            "choices": [choice],
            "usage": self.usage(),
            "system_fingerprint": None,
            "prompt_token_ids": self.prompt_ids,
        }


class CompletionShaper(ResponseShaper):
    """/v1/completions: the text as "text", the legacy logprobs shape (with text offsets)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"
    prompt_ids_in_choice = True
    final_choice_extras = {"prompt_logprobs": None}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_offset = 0

    def text_fields(self, text: str, final: bool) -> dict:
        return {"text": text}

    def delta_logprobs(self, out: RequestOutput) -> dict:
        tokens = [self.state.token_text(t) for t in out.new_token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        if out.new_top_logprobs:
            tops = [self.top_dict(entry) for entry in out.new_top_logprobs]
        else:  # logprobs=0: the chosen token only
            tops = [{tok: _logprob(lp)} for tok, lp in zip(tokens, out.new_logprobs)]
        return {
            "tokens": tokens,
            "token_logprobs": [_logprob(lp) for lp in out.new_logprobs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }


class ChatShaper(ResponseShaper):
    """/v1/chat/completions: the text as the assistant's message (a delta in a chunk), the
    chat logprobs shape; a stream opens with the assistant's role. With tools, the reply's calls
    are the message's `tool_calls` (streamed as OpenAI's deltas: the name with the call's id
    first, then argument fragments) and a reply that called ends with finish_reason
    "tool_calls"."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args, tools: Optional[ToolPlan] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = tools
        parser = tools.stream_parser() if tools is not None else None
        self.call_stream = ToolCallStream(parser) if parser is not None else None
        self.call_ids: list[str] = []
        self.called = False
        self.last_delta = False

    def text_fields(self, text: str, final: bool) -> dict:
        if self.tools is None:
            if final:
                return {"message": {"role": "assistant", "content": text, "refusal": None, "tool_calls": []}}
            return {"delta": {"content": text}}
        if final:
            reply = self.tools.read_reply(text)
            self.called = bool(reply.calls)
            calls = [self._call(i, call) for i, call in enumerate(reply.calls)]
            return {"message": {"role": "assistant", "content": reply.content, "refusal": None, "tool_calls": calls}}
        content, deltas = self._stream_deltas(text)
        delta: dict[str, Any] = {"content": content} if content else {}
        if deltas:
            self.called = True
            delta["tool_calls"] = [self._delta(d) for d in deltas]
        return {"delta": delta}

    def _stream_deltas(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        assert self.tools is not None
        if self.tools.choice == "named":  # the whole reply is the arguments
            deltas = [] if self.call_ids else [ToolCallDelta(0, name=self.tools.named)]
            return "", deltas + ([ToolCallDelta(0, arguments=text)] if text else [])
        if self.call_stream is None:  # tool_choice none: text
            return text, []
        content, deltas = self.call_stream.feed(text)
        if self.last_delta:
            more, rest = self.call_stream.finish()
            content, deltas = content + more, deltas + rest
        if not self.tools.parallel:
            deltas = [d for d in deltas if d.index == 0]
        return content, deltas

    def _call_id(self, index: int) -> str:
        while len(self.call_ids) <= index:
            self.call_ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self.call_ids[index]

    def _call(self, index: int, call: ToolCall) -> dict:
        function = {"name": call.name, "arguments": call.arguments}
        return {"id": self._call_id(index), "type": "function", "function": function}

    def _delta(self, delta: ToolCallDelta) -> dict:
        if delta.name is not None:
            function = {"name": delta.name, "arguments": delta.arguments}
            return {"index": delta.index, "id": self._call_id(delta.index), "type": "function", "function": function}
        return {"index": delta.index, "function": {"arguments": delta.arguments}}

    def chunk(self, out: RequestOutput, include_usage: bool, continuous_usage: bool) -> Optional[dict]:
        self.last_delta = out.finished
        return super().chunk(out, include_usage, continuous_usage)

    def choice(self, text, logprobs, finish_reason, stop_reason, token_ids, final) -> dict:
        choice = super().choice(text, logprobs, finish_reason, stop_reason, token_ids, final)
        if self.called and choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"  # OpenAI's reason for a reply that called
        return choice

    def delta_logprobs(self, out: RequestOutput) -> dict:
        content = []
        tops = out.new_top_logprobs or [[] for _ in out.new_token_ids]
        for token_id, lp, top in zip(out.new_token_ids, out.new_logprobs, tops):
            content.append(
                {
                    **self._entry(token_id, lp),
                    "top_logprobs": [self._entry(t, tlp) for t, tlp in top[: self.num_logprobs]],
                }
            )
        return {"content": content}

    def _entry(self, token_id: int, lp: float) -> dict:
        text = self.state.token_text(token_id)
        return {"token": text, "logprob": _logprob(lp), "bytes": list(text.encode("utf-8"))}

    def opening_chunks(self) -> list[dict]:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
            "token_ids": [],
        }
        return [{**self.head(self.chunk_object_name), "choices": [choice], "prompt_token_ids": self.prompt_ids_once()}]

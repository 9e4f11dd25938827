"""The tool calls in a model's text, found once at the end or as they stream.

Two formats the model may choose to write, as vLLM's and SGLang's parsers name them
(`--tool-call-parser`; what `tool_choice: auto` parses):
- `hermes`: each call a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
  `</tool_call>` (Hermes, Qwen 2.5/3, and the generic rendering of templates without tools);
- `llama3_json`: the whole answer is calls, `{"name": ..., "parameters": {...}}` objects separated by
  `;`, optionally after `<|python_tag|>` (Llama 3.1+);
and `json_array`, the array of `{"name": ..., "parameters": ...}` that `tool_choice: required`'s
grammar makes any model write (vLLM's shape for it).

A call's `arguments` is the JSON text of its arguments value exactly as the model wrote it (a JSON
string value is decoded: some models write the arguments as a string), never re-serialized, so the
streamed fragments are pieces of the same text the non-streamed answer carries. The stream is
computed from the same parse as the final answer and only ever extends what it has sent, so the
deltas reassemble to the non-streamed result for every split of the text into chunks.

Content is the text outside calls, stripped at both ends (None when nothing is left). A call
counts once its name is complete, whether its arguments are (a reply cut by max_tokens keeps its
partial arguments; a grammar-forced call is always complete).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text; partial when the reply was cut short
    complete: bool = True


@dataclass(frozen=True)
class ParsedReply:
    content: Optional[str]
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of call `index`: its name once (first), then argument fragments."""

    index: int
    name: Optional[str] = None
    arguments: str = ""


@dataclass
class _ObjectScan:
    """Where a JSON object's top-level values are in the text: key -> (start, end or None)."""

    fields: dict[str, tuple[int, Optional[int]]] = field(default_factory=dict)
    end: Optional[int] = None  # just past the closing brace, once it came


def scan_object(text: str, start: int) -> _ObjectScan:
    """Scan the JSON object starting at text[start] ('{') as far as the text goes."""
    scan = _ObjectScan()
    depth, in_string, escaped = 0, False, False
    state, key, token_start, value_start = "key", None, start, start
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and state == "key":
                    key, state = _json_string(text[token_start : i + 1]), "colon"
            continue
        if c == '"':
            in_string, token_start = True, i
        if depth == 1 and state == "value" and not c.isspace():
            value_start, state = i, "in_value"
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                _close_value(scan, state, key, value_start, i)
                scan.end = i + 1
                return scan
        elif depth == 1 and c == ":" and state == "colon":
            state = "value"
        elif depth == 1 and c == ",":
            _close_value(scan, state, key, value_start, i)
            state = "key"
    if state == "in_value" and key is not None:
        scan.fields[key] = (value_start, None)
    return scan


def _close_value(scan: _ObjectScan, state: str, key: Optional[str], value_start: int, end: int) -> None:
    if state == "in_value" and key is not None:
        scan.fields[key] = (value_start, end)


def _json_string(text: str) -> Optional[str]:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _call_in(text: str, start: int) -> tuple[Optional[ToolCall], Optional[int]]:
    """The call whose object starts at `start` (None until its name is complete), and the
    object's end (None while open)."""
    scan = scan_object(text, start)
    name_span = scan.fields.get("name")
    if name_span is None or name_span[1] is None:
        return None, scan.end
    name = _json_string(text[name_span[0] : name_span[1]].rstrip())
    if name is None:
        return None, scan.end
    args_span = scan.fields.get("arguments", scan.fields.get("parameters"))
    if args_span is None:
        return ToolCall(name, "" if scan.end is None else "{}", scan.end is not None), scan.end
    args_start, args_end = args_span
    if args_end is None:  # still arriving: the text so far, less a trailing run of whitespace
        raw = text[args_start:].rstrip()
        return ToolCall(name, "" if raw.startswith('"') else raw, False), scan.end
    raw = text[args_start:args_end].rstrip()
    decoded = _json_string(raw) if raw.startswith('"') else None
    return ToolCall(name, decoded if decoded is not None else raw, scan.end is not None), scan.end


def _parse_hermes(text: str, final: bool) -> tuple[list[str], list[ToolCall]]:
    """Outside pieces and calls. While the text grows, a block that has not named its call yet
    and a suffix that may be the start of a tag are held back; at the end both are text."""
    outside: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while True:
        tag = text.find(HERMES_OPEN, pos)
        if tag < 0:
            outside.append(text[pos:] if final else _without_partial_tag(text[pos:], HERMES_OPEN))
            return outside, calls
        outside.append(text[pos:tag])
        brace = _first_non_space(text, tag + len(HERMES_OPEN))
        call, end = _call_in(text, brace) if brace is not None and text[brace] == "{" else (None, None)
        if call is None:
            return outside + ([text[tag:]] if final else []), calls
        calls.append(call)
        close = -1 if end is None else text.find(HERMES_CLOSE, end)
        if close < 0:
            return outside, calls
        pos = close + len(HERMES_CLOSE)


def _parse_llama3(text: str, final: bool) -> tuple[list[str], list[ToolCall]]:
    """([text], []) once the answer is known to be text; calls otherwise, nothing outside them.
    At the end, an answer without a call is text."""
    outside, calls = _llama3_calls(text)
    return ([text], []) if final and not calls else (outside, calls)


def _llama3_calls(text: str) -> tuple[list[str], list[ToolCall]]:
    begin = _first_non_space(text, 0)
    if begin is None:
        return [], []
    if text.startswith(PYTHON_TAG, begin):
        begin = _first_non_space(text, begin + len(PYTHON_TAG))
        if begin is None:
            return [], []
    elif PYTHON_TAG.startswith(text[begin:]):
        return [], []  # may be the tag, still arriving
    if text[begin] != "{":
        return [text], []
    return [], _calls_separated_by(text, begin, ";")


def _calls_separated_by(text: str, pos: Optional[int], separator: str) -> list[ToolCall]:
    """The call objects from text[pos] on, one after another with `separator` between them."""
    calls: list[ToolCall] = []
    while pos is not None and text[pos] == "{":
        call, end = _call_in(text, pos)
        if call is not None:
            calls.append(call)
        if end is None:
            break
        after = _first_non_space(text, end)
        pos = _first_non_space(text, after + 1) if after is not None and text[after] == separator else None
    return calls


def _first_non_space(text: str, pos: int) -> Optional[int]:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos if pos < len(text) else None


def _without_partial_tag(piece: str, tag: str) -> str:
    """`piece` less a suffix that could be the start of `tag`."""
    for cut in range(min(len(tag) - 1, len(piece)), 0, -1):
        if tag.startswith(piece[-cut:]):
            return piece[:-cut]
    return piece


def _parse_json_array(text: str, final: bool) -> tuple[list[str], list[ToolCall]]:
    """`[{"name": ..., "parameters": {...}}, ...]`: what `tool_choice: required` makes the model
    write (its grammar forces the shape), so there is never text outside the calls."""
    pos = _first_non_space(text, 0)
    if pos is None or text[pos] != "[":
        return ([text] if final and pos is not None else []), []
    return [], _calls_separated_by(text, _first_non_space(text, pos + 1), ",")


_PARSE = {"hermes": _parse_hermes, "llama3_json": _parse_llama3, "json_array": _parse_json_array}


def parse_reply(text: str, parser: str) -> ParsedReply:
    """The whole reply's content and calls."""
    outside, calls = _PARSE[parser](text, True)
    content = "".join(outside).strip()
    return ParsedReply(content or None, tuple(calls))


class ToolCallStream:
    """Deltas of content and calls as the reply's text grows, each only extending what was sent."""

    def __init__(self, parser: str):
        self.parser = parser
        self.text = ""
        self.sent_content = ""  # stripped at the start; its trailing whitespace held back
        self.sent_calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        outside, calls = _PARSE[self.parser](self.text, False)
        return self._content_delta("".join(outside).lstrip().rstrip()), self._call_deltas(calls)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left to send once the reply ended: exactly the non-streamed result's rest."""
        final = parse_reply(self.text, self.parser)
        return self._content_delta(final.content or ""), self._call_deltas(list(final.calls))

    def _content_delta(self, content: str) -> str:
        if not content.startswith(self.sent_content):
            return ""  # never retract; the final parse extends what was sent (see the module doc)
        delta, self.sent_content = content[len(self.sent_content) :], content
        return delta

    def _call_deltas(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.sent_calls):
                self.sent_calls.append(ToolCall(call.name, "", False))
                deltas.append(ToolCallDelta(index, name=call.name))
            sent = self.sent_calls[index]
            if call.arguments.startswith(sent.arguments) and len(call.arguments) > len(sent.arguments):
                deltas.append(ToolCallDelta(index, arguments=call.arguments[len(sent.arguments) :]))
                self.sent_calls[index] = call
        return deltas

"""OpenAI tools on a chat request: what the client offers and requires, how the prompt shows the
tools, what grammar forces a call, and how the reply is read back into calls.

- `tool_choice: none`: the tools are shown, the reply is text.
- `auto` (the default with tools): the model decides; its reply is parsed in the server's
  `--tool-call-parser` format (serving/http/tool_call_parsing.py).
- `required`: a grammar makes the reply a JSON array of `{"name", "parameters"}` calls of the offered
  functions (one item if `parallel_tool_calls` is false), so every call is valid for its schema.
- a named function: a grammar makes the whole reply that function's arguments.
This is vLLM's scheme; with `auto`, `parallel_tool_calls: false` keeps the first call.

The prompt: a chat template that uses `tools` (Hermes, Qwen, Llama 3.1+, Mistral) gets them as Hugging
Face's apply_chat_template passes them, and the history's assistant `tool_calls` with their arguments
as objects. Any other template (the default model's), or none, gets the generic rendering: a system
message listing the tools as JSON and asking for `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
(the hermes format), the history's calls written that way and tool results as `<tool_response>` user
turns.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from dist_infer.serving.http.json_body import ProtocolError
from dist_infer.serving.http.tool_call_parsing import PARSERS, ParsedReply, ToolCall, parse_reply

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # the body fields read here
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
GENERIC_TOOLS_PROMPT = (
    "You may call one or more functions to answer. To call one, reply with\n"
    '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>\n'
    "one block per call. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>"
)


@dataclass(frozen=True)
class Tool:
    name: str
    function: dict  # as the client sent it: name, description, parameters, strict


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools, what it requires of the reply and how the reply is read."""

    tools: tuple[Tool, ...]
    choice: str  # none | auto | required | named
    named: Optional[str] = None
    parallel: bool = True
    parser: str = "hermes"

    def output_schema(self) -> Optional[dict]:
        """The JSON schema a grammar holds the reply to (required, named), else None."""
        if self.choice == "named":
            return parameters_of(next(t for t in self.tools if t.name == self.named).function)
        if self.choice == "required":
            return required_calls_schema(self.tools, self.parallel)
        return None

    def stream_parser(self) -> Optional[str]:
        """The format the reply's calls are read in as it streams (None: text, or named)."""
        return {"required": "json_array", "auto": self.parser}.get(self.choice)

    def read_reply(self, text: str) -> ParsedReply:
        """The whole reply as content and calls."""
        if self.choice == "named":
            return ParsedReply(None, (ToolCall(str(self.named), text),))
        parser = self.stream_parser()
        if parser is None:
            return ParsedReply(text or None)
        reply = parse_reply(text, parser)
        if not self.parallel and len(reply.calls) > 1:
            return ParsedReply(reply.content, reply.calls[:1])
        return reply

    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": t.function} for t in self.tools]


def tool_plan_of(body: Mapping[str, Any], parser: str = "hermes") -> Optional[ToolPlan]:
    """The body's tools, tool_choice and parallel_tool_calls, checked (None: no tools)."""
    if parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; one of {', '.join(PARSERS)}")
    tools = _tools(body.get("tools"))
    choice, named = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if not tools:
        return None
    return ToolPlan(tools, choice, named, parallel is not False, parser)


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ProtocolError("tools", f"tools must be a list of at most {MAX_TOOLS} functions")
    tools, seen = [], set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ProtocolError("tools", f'{where} must be {{"type": "function", "function": {{...}}}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ProtocolError("tools", f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ProtocolError("tools", f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if name in seen:
            raise ProtocolError("tools", f"{where}.function.name {name!r} is offered twice")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ProtocolError("tools", f"{where}.function.parameters must be a JSON schema object")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ProtocolError("tools", f"{where}.function.description must be a string")
        seen.add(name)
        tools.append(Tool(name, function))
    return tuple(tools)


def _choice(value: Any, tools: tuple[Tool, ...]) -> tuple[str, Optional[str]]:
    if value is None:
        return ("auto" if tools else "none"), None
    if not tools and value != "none":
        raise ProtocolError("tool_choice", "tool_choice needs tools: send the functions the model may call")
    if isinstance(value, str):
        if value not in CHOICES:
            raise ProtocolError("tool_choice", f"tool_choice must be one of {', '.join(CHOICES)} or a function")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ProtocolError(
            "tool_choice", 'tool_choice must name a function: {"type": "function", "function": {"name": ...}}'
        )
    if name not in {t.name for t in tools}:
        raise ProtocolError("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return "named", name


def parameters_of(function: Mapping[str, Any]) -> dict:
    """A function's parameters schema; none given means it takes an empty object."""
    params = function.get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def required_calls_schema(tools: tuple[Tool, ...], parallel: bool) -> dict:
    """A non-empty array of calls of the offered functions, each with valid parameters; every
    tool's `$defs` lifted to the top, where its `$ref`s point (a clash is a 400)."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        params = copy.deepcopy(parameters_of(tool.function))
        for key in ("$defs", "definitions"):
            for name, definition in (params.pop(key, None) or {}).items():
                if name in defs and defs[name] != definition:
                    raise ProtocolError("tools", f"tools define {key} {name!r} differently")
                defs[name] = definition
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_uses_tools(source: Optional[str]) -> bool:
    """Whether a chat template renders a `tools` variable (HF's tool-use templates do)."""
    return bool(source) and re.search(r"\btools\b", source or "") is not None


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as tool-use templates expect it: each call's arguments an object, not text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(message)
    return out


def _with_object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def generic_tool_messages(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The history for a template without tools: a system turn listing them, calls as
    `<tool_call>` blocks in the assistant's text, tool results as `<tool_response>` user turns."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.template_tools())
    out: list[dict[str, Any]] = [{"role": "system", "content": GENERIC_TOOLS_PROMPT.replace("{tools}", listing)}]
    for message in messages:
        role = message.get("role")
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message.get('content', '')}\n</tool_response>"})
            continue
        calls = message.get("tool_calls")
        if role == "assistant" and isinstance(calls, list) and calls:
            blocks = [_call_block(c) for c in calls]
            text = "\n".join(filter(None, [message.get("content") or "", *blocks]))
            out.append({"role": "assistant", "content": text})
            continue
        out.append({k: v for k, v in message.items() if k != "tool_calls"})
    return out


def _call_block(call: Any) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return ""
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass
    block = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>{block}</tool_call>"

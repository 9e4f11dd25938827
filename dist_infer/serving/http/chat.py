"""Chat messages -> one prompt string, the way the model was trained to read them.

With a chat template (the jinja2 `chat_template` of the checkpoint's tokenizer_config.json) the
messages are rendered as Hugging Face's `apply_chat_template` renders them: a sandboxed jinja2
environment (templates come with downloaded checkpoints, so they must not reach Python
internals), trim_blocks/lstrip_blocks, `raise_exception`, a `tojson` filter, and the variables
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`.

Without a template the plain fallback format is one line per message, the role capitalized,
then an open assistant turn:

    System: You are terse.
    User: Say hello
    Assistant:

(no special tokens; the tokenizer adds BOS). It is only a readable default for base models.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Optional

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dist_infer.serving.http.tools import ToolPlan, generic_tool_messages, messages_for_template, template_uses_tools

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatError(ValueError):
    """Messages we cannot render (bad shape, or the template refused them); `field` is the param."""

    def __init__(self, message: str, field: str = "messages"):
        super().__init__(message)
        self.field = field


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the OpenAI message list and flatten content parts to text (templates expect strings)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise ChatError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        normalized = dict(message)
        normalized["content"] = _text_of(message.get("content"), i)
        out.append(normalized)
    return out


def _text_of(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"messages[{i}].content: only text parts are supported, got {kind!r}")
        return "".join(texts)
    raise ChatError(f"messages[{i}].content must be a string or a list of text parts, got {type(content).__name__}")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatRenderer:
    """One model's way of turning messages into a prompt; the template is compiled once."""

    def __init__(self, chat_template: Optional[str], bos_token: str = "", eos_token: str = ""):
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.template = None
        self.renders_tools = template_uses_tools(chat_template)
        if chat_template:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self.template = env.from_string(chat_template)
            except jinja2.TemplateError as exc:
                raise ValueError(f"the chat template does not compile: {exc}") from exc

    @classmethod
    def for_tokenizer(cls, chat_template: Optional[str], tokenizer) -> "ChatRenderer":
        """bos_token/eos_token as the template expects them: the tokenizer's strings for its BOS/EOS ids."""
        return cls(chat_template, _token_text(tokenizer, "bos_id"), _token_text(tokenizer, "eos_id"))

    def render(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        extra: Optional[dict[str, Any]] = None,
        tools: Optional[ToolPlan] = None,
    ) -> str:
        """The prompt; with `tools`, shown as the template shows them, or generically (tools.py)."""
        messages = normalize_messages(messages)
        context = dict(extra or {})
        if self.renders_tools:
            messages = messages_for_template(messages)
            if tools is not None:
                context["tools"] = tools.template_tools()
        elif tools is not None:
            messages = generic_tool_messages(messages, tools)
        if self.template is None:
            return plain_chat_prompt(messages, add_generation_prompt)
        context.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        try:
            return self.template.render(**context)
        except jinja2.TemplateError as exc:  # raise_exception("roles must alternate"), sandbox refusals
            raise ChatError(f"the chat template refused these messages: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a template bug must be the client's 400, not our 500
            raise ChatError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from exc


def plain_chat_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The fallback format (see the module docstring)."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)


def _token_text(tokenizer, attr: str) -> str:
    token_id = getattr(tokenizer, attr, None) if tokenizer is not None else None
    to_text = getattr(tokenizer, "token", None)
    if token_id is None or to_text is None:
        return ""
    return to_text(token_id) or ""

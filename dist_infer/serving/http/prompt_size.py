"""Refusing a prompt that cannot fit the model's context before any work is spent on it.

Tokenizing a prompt of megabytes takes seconds of a core, only for the engine to refuse its millions
of tokens afterwards (docs/security.md, "Bounded input"). A prompt of more characters than
max_model_len tokens can cover (each covers at most the tokenizer's max_chars_per_token characters:
engine/token_chars.py) makes more tokens than the model has positions whatever the text, so it gets
its 400 from its length alone; so does
a prompt of more token ids than positions. For chat the message contents are summed: the template
only adds text. The errors are OpenAI's `context_length_exceeded`, worded as vLLM words them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dist_infer.serving.http.guard import ApiError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for this


@dataclass(frozen=True)
class PromptLimits:
    """The most a prompt may be: max_model_len tokens, and (where the tokenizer bounds the
    characters per token) max_model_len * chars_per_token characters."""

    max_model_len: int
    chars_per_token: Optional[int] = None

    @classmethod
    def of(cls, max_model_len: int, tokenizer: Any) -> "PromptLimits":
        """The limits for a model; the tokenizer's bound is computed here, once (None without one)."""
        return cls(max_model_len, getattr(tokenizer, "max_chars_per_token", None) if tokenizer is not None else None)

    @property
    def max_chars(self) -> Optional[int]:
        return None if self.chars_per_token is None else self.max_model_len * self.chars_per_token

    def check_chars(self, chars: int, field: str) -> None:
        """Refuse `chars` characters of text that cannot fit (a 400 naming `field` and the bound)."""
        limit = self.max_chars
        if limit is not None and chars > limit:
            noun = "messages have" if field == "messages" else f"{field} has"
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, and no token "
                f"of its tokenizer covers more than {self.chars_per_token} characters, so at most "
                f"{limit:,} characters can fit. However, your {noun} {chars:,} characters. "
                f"Please reduce the length of the {field}.",
                field,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def check_tokens(self, count: int, field: str) -> None:
        """Refuse a prompt of `count` tokens (or token ids) that cannot fit."""
        if count > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{field} has {count:,} tokens. Please reduce the length of the {field}.",
                field,
                code=CONTEXT_LENGTH_EXCEEDED,
            )

    def check_completion_prompt(self, value: Any) -> None:
        """A completions `prompt` as sent (a string, token ids, or a list of one of those), checked
        by its length alone; what else is wrong with it is protocol.prompt_of's to say."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, str):
            self.check_chars(len(value), "prompt")
        elif isinstance(value, list) and value and not isinstance(value[0], (str, list)):
            self.check_tokens(len(value), "prompt")

    def check_messages(self, messages: Any) -> None:
        self.check_chars(message_chars(messages), "messages")


def message_chars(messages: Any) -> int:
    """The characters of the messages' text contents (strings, or text parts), whatever else is in
    them: chat.normalize_messages refuses what is malformed, later."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else part
                total += len(text) if isinstance(text, str) else 0
    return total

"""The request fields of OpenAI's and vLLM's schemas that this server does not serve, as one table.

A client that asks for one of them (banned words, a second choice, ...) gets a 400
naming the field (`param`), not a 200 that silently ignored it: the answer would be other than the
one it asked for. A value that asks for nothing is accepted, as vLLM accepts its own defaults:
null, and each row's `noop` values (`n: 1`, `logit_bias: {}`, `echo: false`).
Rows whose `noop` is ANY are hints that change no answer (caching keys, abuse-monitoring ids):
they are listed so the decision is written down, and any value is accepted.

Values compare by JSON type as well as value: `false` is not `0`, but `1.0` is `1` (integral
floats count as integers throughout the API; engine.sampling's `_as_integer`). Fields in neither
schema are not here: protocol.py ignores them, as OpenAI-compatible servers (vLLM) do.

Sources: the openai client's `completion_create_params` (completions and chat) and vLLM's
`vllm/entrypoints/openai/protocol.py` (CompletionRequest, ChatCompletionRequest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

ANY = "any value"  # a row's noop: the field is a hint, accepted whatever it holds


@dataclass(frozen=True)
class Unserved:
    """Why a field is not served, and the values (besides null) that ask for nothing."""

    why: str
    noop: Union[tuple[Any, ...], str] = ()

    def accepts(self, value: Any) -> bool:
        return value is None or self.noop == ANY or any(_same_json(value, v) for v in self.noop)


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: a boolean equals only a boolean (in Python, True == 1)."""
    return (type(a) is bool) == (type(b) is bool) and a == b


_NO_PENALTIES = "the sampler applies no penalties"
_NO_GUIDED = "not this form of structured output (response_format, structured_outputs and guided_json/regex/choice/grammar are served)"
_NO_TOOLS = "the legacy function-calling fields are not served; send tools and tool_choice"
_NOT_STORED = "nothing is stored"
_CACHE_HINT = "a prompt-caching hint; prefixes are cached on their own, the answer is the same"

# field -> why it is not served, for both endpoints (a row for one endpoint's field costs the other nothing)
UNSERVED: dict[str, Unserved] = {
    # OpenAI, completions and chat
    "n": Unserved("one choice per request", (1,)),
    "best_of": Unserved("one candidate per request", (1,)),
    "echo": Unserved("the prompt is not returned with the output", (False,)),
    "suffix": Unserved("text is only generated after the prompt, never inserted", ("",)),
    "presence_penalty": Unserved(_NO_PENALTIES, (0,)),
    "frequency_penalty": Unserved(_NO_PENALTIES, (0,)),
    "logit_bias": Unserved("the sampler does not bias logits", ({},)),
    # OpenAI, chat
    "functions": Unserved(_NO_TOOLS, ([],)),
    "function_call": Unserved(_NO_TOOLS, ("none",)),
    "audio": Unserved("text output only"),
    "modalities": Unserved("text output only", (["text"],)),
    "prediction": Unserved("no predicted outputs"),
    "reasoning_effort": Unserved("no reasoning-effort control"),
    "verbosity": Unserved("no verbosity control", ("medium",)),
    "web_search_options": Unserved("no web search"),
    "moderation": Unserved("no moderation"),
    "store": Unserved(_NOT_STORED, (False,)),
    "metadata": Unserved(f"{_NOT_STORED} to attach it to", ({},)),
    "service_tier": Unserved("one service tier", ("auto", "default")),
    "prompt_cache_key": Unserved(_CACHE_HINT, ANY),
    "prompt_cache_retention": Unserved(_CACHE_HINT, ANY),
    "prompt_cache_options": Unserved(_CACHE_HINT, ANY),
    "safety_identifier": Unserved("an abuse-monitoring id, like `user`; the answer is the same", ANY),
    # vLLM's sampling extras
    "use_beam_search": Unserved("no beam search", (False,)),
    "length_penalty": Unserved("no beam search, which it weighs", (1,)),
    "min_p": Unserved("no min-p filter", (0,)),
    "repetition_penalty": Unserved(_NO_PENALTIES, (1,)),
    "include_stop_str_in_output": Unserved("the text is cut before a stop string", (False,)),
    "skip_special_tokens": Unserved("special tokens are always left out of the text", (True,)),
    "spaces_between_special_tokens": Unserved("special tokens are left out of the text", (True,)),
    "truncate_prompt_tokens": Unserved("prompts are not truncated (a prompt too long is a 400)"),
    "prompt_logprobs": Unserved("no log-probabilities of the prompt"),
    "allowed_token_ids": Unserved("no restriction of the vocabulary"),
    "bad_words": Unserved("no banned words", ([],)),
    "logits_processors": Unserved("no custom logits processors", ([],)),
    "return_tokens_as_token_ids": Unserved("logprobs' tokens are text (token_ids holds the ids)", (False,)),
    # vLLM's guided decoding
    "guided_whitespace_pattern": Unserved(_NO_GUIDED),
    "structural_tag": Unserved(_NO_GUIDED),
    # vLLM's prompt and chat extras
    "prompt_embeds": Unserved("prompts are text or token ids"),
    "continue_final_message": Unserved("the last message is never continued", (False,)),
    "documents": Unserved("the template gets no documents (chat_template_kwargs can pass them)", ([],)),
    "chat_template": Unserved("only the checkpoint's chat template is run"),
    "include_reasoning": Unserved("no reasoning parser: any reasoning stays in the content", (True,)),
    "mm_processor_kwargs": Unserved("text models only", ({},)),
    "media_io_kwargs": Unserved("text models only", ({},)),
    # vLLM's serving extras
    "priority": Unserved("requests are served in arrival order", (0,)),
    "request_id": Unserved("the server names each request (X-Request-Id)"),
    "kv_transfer_params": Unserved("KV transfer is the cluster's own"),
    "vllm_xargs": Unserved("no custom extensions", ({},)),
}

# add_special_tokens, whose default differs by endpoint in vLLM (completions: add a BOS; chat: leave
# special tokens to the template). Ours: the tokenizer's BOS, unless the rendered prompt starts with it.
COMPLETIONS_UNSERVED = {
    **UNSERVED,
    "add_special_tokens": Unserved("a text prompt always gets the tokenizer's BOS", (True,)),
}
CHAT_UNSERVED = {
    **UNSERVED,
    "add_special_tokens": Unserved("no special tokens are added to the template's but a missing BOS", (False,)),
}


def first_unserved(body: Mapping[str, Any], table: Mapping[str, Unserved]) -> Optional[tuple[str, str]]:
    """(field, message) for the body's first field that asks for what `table` says is not served."""
    for name, value in body.items():
        row = table.get(name)
        if row is not None and not row.accepts(value):
            return name, f"{name}: {_short(value)} is not supported ({row.why}); {_leave_out(row)}"
    return None


def _leave_out(row: Unserved) -> str:
    shown = " or ".join(_short(v) for v in row.noop) if isinstance(row.noop, tuple) else ""
    return f"leave it out, or send null or {shown}" if shown else "leave it out, or send null"


def _short(value: Any, limit: int = 60) -> str:
    """`value` as the client wrote it (JSON), cut to `limit` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except ValueError:  # an integer of more digits than Python converts
        return "an integer too large to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""The OpenAI request bodies we accept, and their translation into the engine's SamplingParams.

Fields follow OpenAI's API plus vLLM's extras (top_k, min_tokens, ignore_eos, stop_token_ids,
return_token_ids, cache_salt, structured outputs in vLLM's forms), so clients written for either work
unchanged. Structured outputs and tools are read by structured_fields.py and tools.py. A field of
either schema that we do not serve (n > 1, echo, penalties, ...: the table in
serving/http/unserved_fields.py) is refused with a 400 naming it unless its value asks for nothing,
rather than silently ignored, since the client would otherwise get something other than what it
asked for. Fields in neither schema are ignored, as OpenAI-compatible servers (vLLM) do: a newer
client's extra must not break it. JSON types are checked, as OpenAI checks them: a boolean or a
string where a number belongs is a 400 (`true` would otherwise be 1), and so is anything but a
boolean where one belongs; an integer may be written as an integral float (4.0), as before.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Mapping, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError
from pydantic_core import PydanticCustomError

from dist_infer.engine.sampling import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from dist_infer.engine.structured.spec import StructuredSpec
from dist_infer.serving.http.json_body import ProtocolError
from dist_infer.serving.http.structured_fields import STRUCTURED_FIELDS, structured_request_of
from dist_infer.serving.http.tools import TOOL_FIELDS, ToolPlan, tool_plan_of
from dist_infer.serving.http.unserved_fields import CHAT_UNSERVED, COMPLETIONS_UNSERVED, Unserved, first_unserved

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS_CAP = 4096  # chat's default max_tokens is "what fits", at most this many
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the engine's own default is greedy)
MAX_STOP_STRINGS = 16  # stop strings per request, each of at most MAX_STOP_CHARS (each is searched per token)
MAX_STOP_CHARS = 512


def _json_number(value: Any) -> Any:
    """A number must be a JSON number: pydantic's lax mode reads `true` as 1 and `"4"` as 4."""
    if type(value) is bool or isinstance(value, (str, bytes)):
        kind = "a boolean" if type(value) is bool else "a string"
        raise PydanticCustomError("json_number", "must be a JSON number, not {kind}", {"kind": kind})
    return value


# integers as the engine can hold them (a 400-digit seed is a 400, not an overflow deep inside)
Int64 = Annotated[int, BeforeValidator(_json_number), Field(ge=-(2**63), le=2**63 - 1)]
Float = Annotated[float, BeforeValidator(_json_number), Field(allow_inf_nan=False)]
Bool = Annotated[bool, Strict()]  # `true` or `false` only, not "yes" or 1

# SamplingParams' names for what the API calls otherwise
_API_NAME = {"max_new_tokens": "max_tokens", "stop_at_eos": "ignore_eos"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: Optional[Bool] = False  # a last chunk with empty choices and the usage
    continuous_usage_stats: Optional[Bool] = False  # vLLM: the usage so far in every chunk


class _GenerationRequest(BaseModel):
    """What completions and chat share: the model, sampling and streaming fields. Fields in
    `unserved` are declared here (n, penalties, ...) for their types; their values are checked
    against that table by parse_body."""

    model_config = ConfigDict(extra="ignore")
    unserved: ClassVar[Mapping[str, Unserved]] = COMPLETIONS_UNSERVED

    model: Optional[str] = None
    max_tokens: Optional[Int64] = None
    temperature: Optional[Float] = None
    top_p: Optional[Float] = None
    top_k: Optional[Int64] = None  # vLLM; -1 or 0: no limit
    seed: Optional[Int64] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[Int64]] = Field(None, max_length=256)  # vLLM; engine.sampling.MAX_STOP_TOKEN_IDS
    ignore_eos: Optional[Bool] = False  # vLLM
    min_tokens: Optional[Int64] = 0  # vLLM
    n: Optional[Int64] = 1
    stream: Optional[Bool] = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: Optional[Bool] = None  # vLLM; accepted, token ids are always returned
    presence_penalty: Optional[Float] = None
    frequency_penalty: Optional[Float] = None
    repetition_penalty: Optional[Float] = None  # vLLM
    logit_bias: Optional[dict[str, Float]] = None
    user: Optional[str] = None
    cache_salt: Optional[str] = None  # vLLM: requests share cached prefixes only with equal salts (sampling checks it)
    # structured outputs (structured_fields.py reads them): OpenAI's, then vLLM's forms
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None

    def structured(self) -> Optional[tuple[str, StructuredSpec]]:
        """The field that asks for a structure and its spec (None: free text); a ProtocolError
        naming the field when the ask is malformed."""
        return structured_request_of({name: getattr(self, name) for name in STRUCTURED_FIELDS})

    @property
    def include_usage(self) -> bool:
        return bool(
            self.stream_options and (self.stream_options.include_usage or self.stream_options.continuous_usage_stats)
        )

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: Any = None  # a string, token ids, or a list of exactly one of those (see prompt_of)
    logprobs: Optional[Int64] = None  # top alternatives per token, 0..MAX_LOGPROBS
    echo: Optional[Bool] = False
    best_of: Optional[Int64] = None
    suffix: Optional[str] = None

    @property
    def num_logprobs(self) -> Optional[int]:
        return self.logprobs


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    unserved: ClassVar[Mapping[str, Unserved]] = CHAT_UNSERVED

    messages: Any = None  # validated by chat.normalize_messages
    logprobs: Optional[Bool] = False
    top_logprobs: Optional[Int64] = None
    max_completion_tokens: Optional[Int64] = None  # OpenAI's newer name for max_tokens; wins over it
    add_generation_prompt: Optional[Bool] = True  # vLLM
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM: more variables for the template
    tools: Any = None  # tools.py reads these three
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    def tool_plan(self, parser: str) -> Optional[ToolPlan]:
        """The body's tools and what it requires of the reply (None: no tools)."""
        return tool_plan_of({name: getattr(self, name) for name in TOOL_FIELDS}, parser)

    @property
    def num_logprobs(self) -> Optional[int]:
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise ProtocolError("top_logprobs", "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM): a prompt, or chat messages rendered with the template."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Any = None
    add_special_tokens: Optional[Bool] = True
    add_generation_prompt: Optional[Bool] = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[Int64]


def parse_body(model_cls: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body: its types, then the fields we do not serve (the model's
    `unserved` table); a ProtocolError naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise ProtocolError(None, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        parsed = model_cls.model_validate(body)
    except ValidationError as exc:
        raise protocol_error_of(exc) from None
    unserved = first_unserved(body, getattr(model_cls, "unserved", {}))
    if unserved is not None:
        raise ProtocolError(*unserved)
    return parsed


def protocol_error_of(exc: ValidationError) -> ProtocolError:
    """pydantic's first error as one readable line with its field."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ())]
    field = loc[0] if loc else None
    where = ".".join(loc) or "body"
    got = first.get("input")
    return ProtocolError(field, f"{where}: {first.get('msg', 'invalid')}, got {_short(got)}")


def _short(value: Any, limit: int = 80) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python converts
        return "an integer too large to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prompt_of(value: Any) -> Union[str, list[int]]:
    """The one prompt of a completions body: a string or token ids, bare or as a list of one.
    A batch of several prompts is refused (one choice per request)."""
    if value is None:
        raise ProtocolError("prompt", "prompt is required")
    if isinstance(value, str):
        if not value:
            raise ProtocolError("prompt", "prompt is empty")
        return value
    if not isinstance(value, list):
        raise ProtocolError("prompt", f"prompt must be a string or a list of token ids, got {type(value).__name__}")
    if not value:
        raise ProtocolError("prompt", "prompt is empty")
    if all(_is_token_id(t) for t in value):
        return list(value)
    if all(isinstance(p, (str, list)) for p in value):
        if len(value) != 1:
            raise ProtocolError("prompt", f"prompt holds a batch of {len(value)} prompts; send one prompt per request")
        return prompt_of(value[0])
    bad = next(t for t in value if not _is_token_id(t))
    raise ProtocolError("prompt", f"prompt token ids must be integers, got {_short(bad)}")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def default_chat_max_tokens(prompt_len: int, max_model_len: int) -> int:
    """Chat without max_tokens: as many as the positions leave (OpenAI's behaviour), capped."""
    return max(0, min(max_model_len - prompt_len, CHAT_MAX_TOKENS_CAP))


def sampling_params_of(
    req: Union[CompletionRequest, ChatCompletionRequest],
    max_tokens: int,
    has_tokenizer: bool,
    structured: Optional[StructuredSpec] = None,
) -> SamplingParams:
    """The engine's SamplingParams for a validated body (with the structure its output must have);
    a ProtocolError naming the API field (not SamplingParams' own names) when a value is out of range."""
    if structured is not None and not has_tokenizer:
        raise ProtocolError("response_format", "structured outputs need a tokenizer and this model has none")
    num_logprobs = req.num_logprobs
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        field = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
        raise ProtocolError(field, f"{field} must be in [0, {MAX_LOGPROBS}], got {num_logprobs}")
    if max_tokens is None or max_tokens < 1:
        raise ProtocolError("max_tokens", f"max_tokens must be an integer >= 1, got {max_tokens}")
    top_k = req.top_k if req.top_k is not None else 0
    if top_k == -1:
        top_k = 0  # vLLM's "off"
    if top_k < 0:
        raise ProtocolError("top_k", f"top_k must be -1 or 0 (off) or >= 1, got {top_k}")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ProtocolError(
            "stop",
            f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            f"characters each, got {len(stop)} of up to {max(map(len, stop))} characters",
        )
    if any(stop) and not has_tokenizer:
        raise ProtocolError("stop", "stop strings need a tokenizer and this model has none; use stop_token_ids")
    temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if not math.isfinite(value):
            raise ProtocolError(name, f"{name} must be a finite number, got {value}")
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=req.seed,
            stop_at_eos=not req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            stop=tuple(stop),
            logprobs=num_logprobs,
            min_tokens=req.min_tokens or 0,
            cache_salt=req.cache_salt,
            structured=structured,
        )
    except SamplingParamsError as exc:
        field = _API_NAME.get(exc.field, exc.field)
        message = str(exc)
        for ours, theirs in _API_NAME.items():
            message = message.replace(ours, theirs)
        raise ProtocolError(field, message) from None


# -- the bodies in /openapi.json ---------------------------------------------------------------------


class MigrateBody(BaseModel):
    """POST /admin/migrate."""

    request_id: str
    to_instance: int
    mode: Optional[str] = "live"


class AddInstanceBody(BaseModel):
    """POST /admin/instances: one --instances item, e.g. decode:tp=2."""

    layout: str


def openapi_body(model_cls: type[BaseModel]) -> dict:
    """A route's `openapi_extra` describing its JSON body by `model_cls` (the route reads and
    validates the body itself, for OpenAI-shaped 400s), with pydantic's $defs inlined."""
    schema = model_cls.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref[len("#/$defs/") :]])
            return {key: inline(child) for key, child in node.items()}
        if isinstance(node, list):
            return [inline(child) for child in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}

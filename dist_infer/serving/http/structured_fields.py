"""The body fields that ask for structured output, read into one engine StructuredSpec.

OpenAI's `response_format` (`json_object`; `json_schema` with its `schema`) and vLLM's forms
(`structured_outputs` with one of json / json_object / regex / choice / grammar, and the older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`) all become the same spec, so one
grammar engine serves every client. A request may ask for one structure: two at once is a 400
naming both fields, as is a value of the wrong shape or beyond the bounds below (checked before
anything compiles). Whether a schema, regex or grammar is one the grammar engine accepts is checked
next, against the tokenizer (engine/structured), also before the request is queued.

`strict` is read and its value does not matter: the grammar is always enforced (vLLM does the same).
A grammar is Lark unless it has GBNF's `::=` (vLLM's rule).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from dist_infer.engine.structured.spec import MAX_SCHEMA_DEPTH, StructuredSpec, StructuredSpecError
from dist_infer.serving.http.json_body import ProtocolError

MAX_CHOICE_CHARS = 1024  # one choice's length (the spec bounds their number, and every text's size)
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")  # vLLM's guided_decoding_backend values we honour

# the body fields read here, in the order a conflict between two of them is reported
STRUCTURED_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)
_STRUCTURED_OUTPUTS_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def structured_spec_of(body: Mapping[str, Any]) -> Optional[StructuredSpec]:
    """The one structure the body asks for (None: free text); a ProtocolError naming the field."""
    asked = structured_request_of(body)
    return asked[1] if asked is not None else None


def structured_request_of(body: Mapping[str, Any]) -> Optional[tuple[str, StructuredSpec]]:
    """The body field that asks for a structure (the `param` of a 400 about it) and its spec."""
    asked = [(name, spec) for name, spec in _each_request(body) if spec is not None]
    if len(asked) > 1:
        names = " and ".join(name for name, _ in asked)
        raise ProtocolError(asked[1][0].split(".")[0], f"{names} each ask for a structure; send one of them")
    _check_backend(body.get("guided_decoding_backend"))
    return (asked[0][0].split(".")[0], asked[0][1]) if asked else None


def _each_request(body: Mapping[str, Any]):
    yield "response_format", _response_format(body.get("response_format"))
    yield from _structured_outputs(body.get("structured_outputs"))
    yield "guided_json", _json_schema("guided_json", body.get("guided_json"))
    yield "guided_regex", _text("guided_regex", "regex", body.get("guided_regex"))
    yield "guided_choice", _choice("guided_choice", body.get("guided_choice"))
    yield "guided_grammar", _grammar("guided_grammar", body.get("guided_grammar"))


def _response_format(value: Any) -> Optional[StructuredSpec]:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ProtocolError("response_format", 'response_format must be an object with a "type"')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("response_format", "json_object", None)
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise ProtocolError("response_format", 'response_format of type "json_schema" needs a "json_schema" object')
        name = inner.get("name")
        if name is not None and not isinstance(name, str):
            raise ProtocolError("response_format", "response_format.json_schema.name must be a string")
        strict = inner.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ProtocolError("response_format", "response_format.json_schema.strict must be a boolean")
        schema = inner.get("schema", {})  # OpenAI makes it optional: no schema allows any JSON value
        return _json_schema("response_format", schema, where="response_format.json_schema.schema")
    raise ProtocolError(
        "response_format", f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}'
    )


def _structured_outputs(value: Any):
    if value is None:
        return
    if not isinstance(value, dict):
        raise ProtocolError("structured_outputs", "structured_outputs must be an object")
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUTS_KEYS) - {"disable_any_whitespace", "whitespace_pattern"})
    if unknown:
        raise ProtocolError("structured_outputs", f"structured_outputs.{unknown[0]} is not supported")
    for option in ("disable_any_whitespace", "whitespace_pattern"):
        if value.get(option) not in (None, False):
            raise ProtocolError("structured_outputs", f"structured_outputs.{option} is not supported; leave it out")
    field = "structured_outputs"
    yield f"{field}.json", _json_schema(field, value.get("json"), where=f"{field}.json")
    if value.get("json_object") not in (None, False):
        if value["json_object"] is not True:
            raise ProtocolError(field, f"{field}.json_object must be a boolean")
        yield f"{field}.json_object", _spec(field, "json_object", None)
    yield f"{field}.regex", _text(field, "regex", value.get("regex"), where=f"{field}.regex")
    yield f"{field}.choice", _choice(field, value.get("choice"), where=f"{field}.choice")
    yield f"{field}.grammar", _grammar(field, value.get("grammar"), where=f"{field}.grammar")


def _spec(field: str, kind: str, value: Any) -> StructuredSpec:
    """The engine's spec (canonical, bounded in size and depth); its refusal as a 400 on `field`."""
    try:
        return StructuredSpec.from_kind(kind, value)
    except StructuredSpecError as exc:
        raise ProtocolError(field, f"{field}: {exc}") from None


def _json_schema(field: str, schema: Any, where: str = "") -> Optional[StructuredSpec]:
    where = where or field
    if schema is None:
        return None
    if isinstance(schema, str):  # vLLM takes a schema as JSON text too
        return _spec(field, "json_schema", schema)
    if not isinstance(schema, dict):
        raise ProtocolError(field, f"{where} must be a JSON schema (an object), got {type(schema).__name__}")
    depth = json_depth(schema)  # before anything walks it recursively
    if depth > MAX_SCHEMA_DEPTH:
        raise ProtocolError(field, f"{where} nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH}")
    return _spec(field, "json_schema", schema)


def _text(field: str, kind: str, value: Any, where: str = "") -> Optional[StructuredSpec]:
    where = where or field
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ProtocolError(field, f"{where} must be a non-empty string")
    return _spec(field, kind, value)


def _grammar(field: str, value: Any, where: str = "") -> Optional[StructuredSpec]:
    spec = _text(field, "lark", value, where)
    if spec is not None and "::=" in spec.value:
        return _spec(field, "ebnf", spec.value)
    return spec


def _choice(field: str, value: Any, where: str = "") -> Optional[StructuredSpec]:
    where = where or field
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise ProtocolError(field, f"{where} must be a non-empty list of strings")
    if any(len(c) > MAX_CHOICE_CHARS for c in value):
        raise ProtocolError(field, f"{where}: each choice may have at most {MAX_CHOICE_CHARS} characters")
    return _spec(field, "choice", value)


def _check_backend(value: Any) -> None:
    if value is not None and value not in GRAMMAR_BACKENDS:
        raise ProtocolError(
            "guided_decoding_backend",
            f"guided_decoding_backend {value!r} is not available; this server's grammar engine is llguidance "
            f"({', '.join(GRAMMAR_BACKENDS)})",
        )


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in a decoded JSON value (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children: Any
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest

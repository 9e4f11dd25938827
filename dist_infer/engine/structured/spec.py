"""What a request's output must look like: a JSON schema, any JSON object, a regex, one of a list of
strings, or a grammar (Lark, or GBNF/EBNF), as one small value that travels with the request.

A spec is plain data (a kind and a text), so it pickles with SamplingParams wherever a request goes
(an instance, a migration, a failover) and hashes to a key the grammar cache goes by. Its text is
canonical (a schema or a choice list is re-serialized without whitespace), so equal requests share a
key whatever their spacing. Key order is kept, not sorted: llguidance writes an object's properties
in the order its schema lists them, so two orders are two different grammars.

The HTTP layer builds a spec from a body with `from_kind`; a StructuredSpecError is a RequestError,
which it already reports as a 400 naming `field`. Nothing here needs a tokenizer: the compiler
(compiler.py) checks the grammar against the model's vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Union

from dist_infer.engine.request_error import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "ebnf")
MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar larger than this is refused before any parse
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema (llama.cpp's converter overflowed its stack on deep ones)
MAX_CHOICES = 4096
COMPACT_JSON = {"whitespace_flexible": False}  # no free whitespace: greedy decoding cannot loop on it


class StructuredSpecError(RequestError):
    """A structured-output spec the engine cannot use (a ValueError and a RequestError: an HTTP 400);
    `field` names the part at fault: the spec's kind, or "structured" for the spec as a whole."""


def _depth(value: Any) -> int:
    """How deeply lists and dicts nest in `value` (iterative: a hostile schema cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            deepest = max(deepest, depth)
            stack += [(child, depth + 1) for child in node if isinstance(child, (dict, list))]
    return deepest


def _parse_json(kind: str, text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise StructuredSpecError(kind, f"{kind} nests too deeply") from None
    except ValueError as exc:
        raise StructuredSpecError(kind, f"{kind} is not valid JSON: {exc}") from None


def canonical_json(value: Any) -> str:
    """The one text of a JSON value: no whitespace, keys in their order (it is the output's order)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _canonical(kind: str, value: str) -> str:
    """`value` checked for its kind, in canonical form."""
    if kind == "json_object":
        return ""
    if kind not in ("json_schema", "choice"):
        if not value:
            raise StructuredSpecError(kind, f"{kind} is empty")
        return value
    parsed = _parse_json(kind, value)
    if _depth(parsed) > MAX_SCHEMA_DEPTH:
        raise StructuredSpecError(kind, f"{kind} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if kind == "json_schema" and not isinstance(parsed, dict):
        raise StructuredSpecError(kind, f"json_schema must be a JSON object, got {type(parsed).__name__}")
    if kind == "choice":
        if not isinstance(parsed, list) or not parsed or not all(isinstance(c, str) for c in parsed):
            raise StructuredSpecError(kind, "choice must be a non-empty list of strings")
        if len(parsed) > MAX_CHOICES:
            raise StructuredSpecError(kind, f"choice may hold at most {MAX_CHOICES} strings, got {len(parsed)}")
    return canonical_json(parsed)


@dataclass(frozen=True)
class StructuredSpec:
    """`kind` (one of KINDS) and its text `value`: a schema as canonical JSON, a choice as a JSON
    list of strings, a regex or grammar as given, "" for json_object. Checked and canonicalized
    when made; StructuredSpecError otherwise."""

    kind: str
    value: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise StructuredSpecError("structured", f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise StructuredSpecError(self.kind, f"{self.kind} must be given as text, got {type(self.value).__name__}")
        if len(self.value) > MAX_SPEC_CHARS:
            raise StructuredSpecError(
                self.kind, f"{self.kind} has {len(self.value)} characters, more than the {MAX_SPEC_CHARS} allowed"
            )
        object.__setattr__(self, "value", _canonical(self.kind, self.value))

    @classmethod
    def from_kind(cls, kind: str, value: Union[str, dict, list, None] = None) -> "StructuredSpec":
        """A spec from what a request body holds: a schema as a dict (or text), a choice as a list
        (or its JSON text), a regex or grammar as text, nothing for json_object."""
        if kind in ("json_schema", "choice") and not isinstance(value, str):
            if kind == "json_schema" and not isinstance(value, dict):
                raise StructuredSpecError(kind, f"json_schema must be a JSON object, got {type(value).__name__}")
            try:
                value = canonical_json(value)
            except (TypeError, ValueError, RecursionError) as exc:
                raise StructuredSpecError(kind, f"{kind} cannot be written as JSON: {exc}") from None
        return cls(kind, "" if value is None else value)

    def key(self) -> str:
        """A hash of the spec: what compiled grammars are cached by."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode("utf-8", "surrogatepass")).hexdigest()

    def to_grammar(self) -> str:
        """The llguidance grammar of this spec (compact JSON, no free whitespace, unless the schema's
        own "x-guidance" says otherwise). A GBNF grammar that cannot be converted raises
        StructuredSpecError; whether the result is valid is the compiler's to check."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.value, defaults=COMPACT_JSON)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=COMPACT_JSON)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return LLMatcher.grammar_from_lark(choice_lark(json.loads(self.value)))
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.value)
        return LLMatcher.grammar_from_lark(ebnf_to_lark(self.value))


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar whose sentences are exactly `choices`: each a JSON-quoted literal, which is
    how Lark (llguidance's) reads a string, escapes included."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def ebnf_to_lark(text: str) -> str:
    """A GBNF (llama.cpp's EBNF) grammar as Lark, by llguidance's converter."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except RecursionError:
        raise StructuredSpecError("ebnf", "ebnf grammar nests too deeply") from None
    except Exception as exc:  # noqa: BLE001 - the converter raises bare Exceptions for grammar errors
        raise StructuredSpecError("ebnf", f"ebnf grammar cannot be converted: {exc}") from None

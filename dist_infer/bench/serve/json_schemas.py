"""`--dataset json-schema`: JSON schemas of many shapes, each with a prompt asking for an instance,
and the check that an answer is one.

The schemas are made from a seed, so a run against another server sends exactly the same ones.
Shapes cycle through flat records with required and optional fields, nested objects, bounded
arrays, arrays of objects, enums, string patterns, anyOf unions, numeric ranges, consts and
top-level arrays. Every string has a maxLength or a bounded pattern and every array a maxItems,
so an answer always has an end a model can reach within a few hundred tokens (a number's
fraction digits are the one thing left unbounded: JSON schema has no bound on them). Each schema comes with an instance built
from it (`example`), which proves it can be met (the tests validate it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

TOPICS = (
    "book", "city", "recipe", "planet", "employee", "song", "river", "car", "movie", "order",
    "museum", "bird", "laptop", "festival", "mountain", "invoice", "garden", "train", "painting", "hotel",
)  # fmt: skip
FIELDS = (
    "name", "title", "year", "count", "price", "rating", "active", "country", "code", "color",
    "size", "score", "notes", "owner", "weight", "label", "status", "level", "origin", "kind",
)  # fmt: skip
WORDS = ("red", "green", "blue", "small", "large", "north", "south", "open", "closed", "new", "old", "gold")
PATTERNS = {  # a pattern and one string that matches it
    r"^[A-Z]{2}-[0-9]{3}$": "AB-123",
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$": "2024-05-17",
    r"^[a-z]{1,12}@[a-z]{1,12}\.(com|org)$": "ann@mail.com",
    r"^#[0-9a-f]{6}$": "#1a2b3c",
    r"^v[0-9]\.[0-9]{1,2}$": "v1.12",
}


@dataclass(frozen=True)
class SchemaCase:
    """One request's schema, the prompt that asks for it, and an instance of it."""

    name: str
    schema: dict
    prompt: str
    example: Any


def _scalar(rng: np.random.Generator) -> tuple[dict, Any]:
    """A bounded scalar's schema and a value of it."""
    kind = int(rng.integers(0, 6))
    if kind == 0:
        n = int(rng.integers(8, 33))
        return {"type": "string", "maxLength": n}, "x" * min(n, 5)
    if kind == 1:
        lo = int(rng.integers(-50, 50))
        hi = lo + int(rng.integers(1, 1000))
        return {"type": "integer", "minimum": lo, "maximum": hi}, lo
    if kind == 2:
        return {"type": "boolean"}, True
    if kind == 3:
        return {"type": "number", "minimum": 0, "maximum": float(rng.integers(1, 500))}, 0.5
    if kind == 4:
        options = [str(w) for w in rng.choice(WORDS, size=int(rng.integers(2, 5)), replace=False)]
        return {"type": "string", "enum": options}, options[-1]
    pattern = list(PATTERNS)[int(rng.integers(0, len(PATTERNS)))]
    return {"type": "string", "pattern": pattern}, PATTERNS[pattern]


def _fields(rng: np.random.Generator, count: int) -> list[str]:
    return [str(f) for f in rng.choice(FIELDS, size=count, replace=False)]


def _record(rng: np.random.Generator, low: int = 2, high: int = 6) -> tuple[dict, Any]:
    """An object of scalars, some required, no other properties."""
    names = _fields(rng, int(rng.integers(low, high)))
    props, example = {}, {}
    for name in names:
        props[name], example[name] = _scalar(rng)
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    example = {k: v for k, v in example.items() if k in required}
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}, example


def _nested(rng: np.random.Generator) -> tuple[dict, Any]:
    inner, inner_example = _record(rng, 2, 4)
    outer, example = _record(rng, 1, 3)
    key = next(f for f in ("details", "address", "meta", "spec") if f not in outer["properties"])
    outer["properties"][key] = inner
    outer["required"] = outer["required"] + [key]
    return outer, dict(example, **{key: inner_example})


def _bounded_list(rng: np.random.Generator) -> tuple[dict, Any]:
    item, value = _scalar(rng)
    lo = int(rng.integers(0, 3))
    hi = lo + int(rng.integers(1, 4))
    outer, example = _record(rng, 1, 3)
    outer["properties"]["items"] = {"type": "array", "items": item, "minItems": lo, "maxItems": hi}
    outer["required"] = outer["required"] + ["items"]
    return outer, dict(example, items=[value] * lo)


def _list_of_records(rng: np.random.Generator) -> tuple[dict, Any]:
    item, value = _record(rng, 2, 3)
    n = int(rng.integers(1, 4))
    schema = {
        "type": "object",
        "properties": {"entries": {"type": "array", "items": item, "minItems": 1, "maxItems": n}},
        "required": ["entries"],
        "additionalProperties": False,
    }
    return schema, {"entries": [value]}


def _union(rng: np.random.Generator) -> tuple[dict, Any]:
    a, a_value = _scalar(rng)
    b, _ = _record(rng, 1, 3)
    outer, example = _record(rng, 1, 3)
    outer["properties"]["value"] = {"anyOf": [a, b]}
    outer["required"] = outer["required"] + ["value"]
    return outer, dict(example, value=a_value)


def _constant(rng: np.random.Generator) -> tuple[dict, Any]:
    outer, example = _record(rng, 2, 4)
    version = int(rng.integers(1, 5))
    outer["properties"]["version"] = {"const": version}
    outer["required"] = outer["required"] + ["version"]
    return outer, dict(example, version=version)


def _top_level_array(rng: np.random.Generator) -> tuple[dict, Any]:
    item, value = _record(rng, 1, 3)
    return {"type": "array", "items": item, "minItems": 1, "maxItems": int(rng.integers(1, 4))}, [value]


SHAPES: tuple[tuple[str, Callable[[np.random.Generator], tuple[dict, Any]]], ...] = (
    ("record", _record),
    ("nested", _nested),
    ("bounded-list", _bounded_list),
    ("list-of-records", _list_of_records),
    ("union", _union),
    ("constant", _constant),
    ("top-level-array", _top_level_array),
)


def schema_cases(count: int, seed: int) -> list[SchemaCase]:
    """`count` schemas, shape i mod len(SHAPES), each from its own stream of `seed`."""
    cases = []
    for i in range(count):
        shape, build = SHAPES[i % len(SHAPES)]
        rng = np.random.default_rng([seed, i])
        schema, example = build(rng)
        topic = TOPICS[int(rng.integers(0, len(TOPICS)))]
        text = json.dumps(schema, separators=(",", ":"))
        prompt = f"Describe a {topic} as JSON. Answer with JSON only, matching this JSON schema: {text}"
        cases.append(SchemaCase(f"{shape}-{i}", schema, prompt, example))
    return cases


def response_format(case: SchemaCase) -> dict:
    """OpenAI's response_format for `case` (json_schema, strict)."""
    return {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema, "strict": True}}


def check_answer(text: str, schema: dict) -> Optional[str]:
    """None if `text` is JSON that validates against `schema`; else why not (one line)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return f"does not validate: {exc.message[:200]}"
    return None

"""`dist-infer generate`'s structured-output flags: what every output must look like (a JSON schema,
any JSON object, a regex, one of some strings, a Lark or GBNF grammar), as the engine's spec.

Parsing the flags loads nothing (the spec module is imported when the spec is made, on the ranks);
a schema or grammar may come from a file (@FILE), since a real one does not fit a command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from dist_infer.engine.structured.spec import StructuredSpec

# flag -> the spec's kind
KINDS = {
    "json_schema": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "lark",
    "ebnf": "ebnf",
}


def add_structured_flags(p: argparse.ArgumentParser) -> None:
    """The structured-output flags, one help section; at most one of them."""
    g = p.add_argument_group(
        "structured outputs (at most one; every output must match it)"
    ).add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="SCHEMA|@FILE", help="a JSON schema (its JSON text, or @FILE)")
    g.add_argument("--json-object", action="store_true", help="any JSON object")
    g.add_argument("--regex", metavar="REGEX", help="a regular expression (Rust regex syntax) the whole output matches")
    g.add_argument("--choice", action="append", metavar="TEXT", help="one of these strings (repeat the flag)")
    g.add_argument("--grammar", metavar="LARK|@FILE", help="a Lark grammar (llguidance's dialect)")
    g.add_argument("--ebnf", metavar="GBNF|@FILE", help="a GBNF grammar (llama.cpp's EBNF), converted to Lark")


def _text(flag: str, value: str) -> str:
    """`value`, or the text of the file it names after '@'."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except OSError as exc:
        raise SystemExit(
            f"dist-infer generate: --{flag.replace('_', '-')} {value}: cannot read it: {exc.strerror or exc}"
        )


def structured_spec(args) -> Optional["StructuredSpec"]:
    """The spec the flags ask for (None: none), or SystemExit naming the flag and what is wrong."""
    from dist_infer.engine.structured.spec import StructuredSpec, StructuredSpecError

    given = [flag for flag in KINDS if getattr(args, flag, None)]
    if not given:
        return None
    flag = given[0]
    value = getattr(args, flag)
    try:
        if flag == "json_object":
            return StructuredSpec.from_kind("json_object")
        if flag == "choice":
            return StructuredSpec.from_kind("choice", list(value))
        return StructuredSpec(KINDS[flag], _text(flag, value))
    except StructuredSpecError as exc:
        raise SystemExit(f"dist-infer generate: --{flag.replace('_', '-')}: {exc}") from None

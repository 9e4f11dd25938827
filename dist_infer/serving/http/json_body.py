"""A request body's JSON: decoded, and refused with a ProtocolError (a 400 naming the field) when
it is not plain JSON the server can work with. Standard library only, so the worker processes
that parse large bodies (serving/http/worker_pool.py) import it in a blink."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

MAX_JSON_DEPTH = 64  # arrays and objects nested deeper than this are refused (no request needs more)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the only way a lone surrogate gets into decoded JSON


class ProtocolError(ValueError):
    """A request body we cannot serve; `field` names the offending input (the `param` of the 400)."""

    def __init__(self, field: Optional[str], message: str):
        super().__init__(message)
        self.field = field


def _no_constant(name: str) -> Any:
    raise ProtocolError(None, f"the request body is not valid JSON: {name} is not a JSON number")


def json_of(raw: bytes) -> Any:
    """A request body's JSON, refused with a ProtocolError (a 400) for everything that is not
    plain JSON the server can work with: bad UTF-8, NaN/Infinity, numbers too large for Python
    or a double, nesting deeper than MAX_JSON_DEPTH, strings with lone surrogates."""
    if not raw.strip():
        raise ProtocolError(None, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(None, f"the request body is not valid UTF-8 (at byte {exc.start})") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError(None, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(None, f"the request body nests arrays or objects more than {MAX_JSON_DEPTH} deep") from None
    except ValueError as exc:  # Python's limit on the digits of an integer
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(None, "the request body holds an integer with more than 4300 digits") from None
    # valid UTF-8 holds no surrogates: only a \\ud800-style escape makes one (the check of every
    # string re-encodes it, which is slow for a large prompt)
    check_json_values(value, check_text=_SURROGATE_ESCAPE.search(raw) is not None)
    return value


def json_result(raw: bytes) -> tuple:
    """json_of as data that crosses processes: ("value", value) or ("error", field, message)."""
    try:
        return ("value", json_of(raw))
    except ProtocolError as exc:
        return ("error", exc.field, str(exc))


def value_of(result: tuple) -> Any:
    """The value of a json_result, or its ProtocolError raised."""
    if result[0] == "error":
        raise ProtocolError(result[1], result[2])
    return result[1]


def check_json_values(value: Any, check_text: bool = True) -> None:
    """Walk decoded JSON (without recursion): nesting depth, strings that are valid Unicode (unless
    `check_text` is False), finite numbers (JSON's 1e400 decodes to inf). The error names the
    top-level field it is under. A list of integers alone (token ids) is passed over in one C call."""
    stack: list[tuple[Any, int, Optional[str]]] = [(value, 0, None)]
    while stack:
        item, depth, field = stack.pop()
        if isinstance(item, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ProtocolError(field, f"the request body nests arrays or objects more than {MAX_JSON_DEPTH} deep")
            if isinstance(item, list) and len(item) > 64 and set(map(type, item)) == {int}:
                continue
            pairs = item.items() if isinstance(item, dict) else ((None, v) for v in item)
            for key, child in pairs:
                where = field if depth else key
                if key is not None and check_text:
                    _check_text(key, where)
                stack.append((child, depth + 1, where))
        elif isinstance(item, str):
            if check_text:
                _check_text(item, field)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ProtocolError(field, f"{field or 'the request body'} holds a number too large for a double")


def _check_text(text: str, field: Optional[str]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise ProtocolError(
            field,
            f"{field or 'the request body'} holds a lone UTF-16 surrogate (\\u{code:04x}), "
            f"which is not a Unicode character",
        ) from None

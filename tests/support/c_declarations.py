"""The kernels' C declarations, read back as ctypes types, to check Python's side against them.

A small reader for our own C (kernels/*.c, *.h), not C at large: function prototypes and
definitions at the top level (one per statement, no function-pointer parameters) and
`typedef struct { ... } Name;` blocks. Every pointer is a c_void_p, as the Python side declares
them; what the reader does not know it raises on, so a new C type cannot slip past the check.
"""

from __future__ import annotations

import ctypes
import re
from typing import Mapping, Optional

SCALARS = {
    "int": ctypes.c_int,
    "long": ctypes.c_long,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "int64_t": ctypes.c_int64,
    "char": ctypes.c_char,
}
_FUNCTION = re.compile(
    r"^(?!static\b|typedef\b)([A-Za-z_][\w \t]*?[\s*]+)([A-Za-z_]\w*)\s*\(([^()]*)\)\s*[;{]", re.MULTILINE
)
_STRUCT = re.compile(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", re.DOTALL)


def strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL))


def ctype_of(declared: str, structs: Optional[Mapping[str, type]] = None):
    """A C type as written (`const float *`, `long`, `StackLinear`) as its ctypes type (None: void)."""
    text = " ".join(declared.replace("const", " ").split())
    if "*" in text:
        return ctypes.c_void_p
    if text == "void":
        return None
    if text in SCALARS:
        return SCALARS[text]
    if structs and text in structs:
        return structs[text]
    raise ValueError(f"the C reader does not know the type {declared!r}")


def _split_parameter(parameter: str) -> tuple[str, str]:
    """`const float *x` -> ('const float *', 'x')."""
    match = re.fullmatch(r"(.*?[\s*])(\w+)", parameter.strip(), re.DOTALL)
    if match is None:
        raise ValueError(f"the C reader cannot split the parameter {parameter!r}")
    return match.group(1), match.group(2)


def function_signatures(text: str) -> dict[str, tuple[Optional[type], list]]:
    """name -> (restype, argtypes) of every non-static function declared or defined at the top level."""
    signatures = {}
    for returns, name, parameters in _FUNCTION.findall(strip_comments(text)):
        if parameters.strip() in ("", "void"):
            argtypes = []
        else:
            argtypes = [ctype_of(_split_parameter(p)[0]) for p in parameters.split(",")]
        signatures[name] = (ctype_of(returns), argtypes)
    return signatures


def struct_fields(text: str, structs: Optional[Mapping[str, type]] = None) -> dict[str, list[tuple[str, object]]]:
    """name -> [(field, ctypes type)] of every `typedef struct { ... } Name;`; a field of a struct
    type takes the ctypes class `structs` gives for that C name."""
    found = {}
    for body, name in _STRUCT.findall(strip_comments(text)):
        fields = []
        for declaration in filter(None, (d.strip() for d in body.split(";"))):
            first, *more = declaration.split(",")  # `const float *cos, *sin`
            match = re.fullmatch(r"([\w\s]+?)\s*(\**\s*\w+(?:\[\d+\])?)", first.strip())
            if match is None:
                raise ValueError(f"the C reader cannot read the field {declaration!r} of {name}")
            base = match.group(1)
            for declarator in [match.group(2), *(d.strip() for d in more)]:
                field = declarator.lstrip("* ")
                ctype = ctype_of(base + "*" * declarator.count("*"), structs)
                array = re.fullmatch(r"(\w+)\[(\d+)\]", field)  # `float *branch[2]`
                fields.append((array.group(1), ctype * int(array.group(2))) if array else (field, ctype))
        found[name] = fields
    return found


def mismatches(
    declared: Mapping[str, tuple[Optional[type], list]], prototypes: Mapping[str, tuple[Optional[type], list]]
) -> list[str]:
    """How the Python side's (restype, argtypes) differ from the C prototypes, one line each."""
    problems = []
    for name, (restype, argtypes) in declared.items():
        if name not in prototypes:
            problems.append(f"{name}: no C prototype")
            continue
        c_restype, c_argtypes = prototypes[name]
        if restype is not c_restype:
            problems.append(
                f"{name}: returns {getattr(c_restype, '__name__', 'void')} in C, "
                f"{getattr(restype, '__name__', 'void')} in Python"
            )
        if len(argtypes) != len(c_argtypes):
            problems.append(f"{name}: {len(c_argtypes)} parameters in C, {len(argtypes)} in Python")
        problems += [
            f"{name}: parameter {i} is {c.__name__} in C, {p.__name__} in Python"
            for i, (p, c) in enumerate(zip(argtypes, c_argtypes, strict=False))
            if p is not c
        ]
    return problems

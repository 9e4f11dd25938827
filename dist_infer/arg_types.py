"""The command line's values: argparse argument types (positive numbers, byte sizes, files) and
taking a flag out of a command line.

Standard library only, and outside the layers (dist_infer/__init__.py): every command line of the
project takes its types from here, the CLI's (`dist_infer.cli`) as well as the ones below it
(`bench-serve`'s flags in `bench.serve.flags`, the instance command lines `serving.placement.spawn` builds,
the launcher's rank command lines).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Optional, Sequence, Union

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def positive_int(text: str) -> int:
    """An integer of at least 1 (--tp, --pp, --num-prompts, ...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def positive_int_or_auto(text: str) -> Union[int, str]:
    """A positive integer, or the word auto (--cp auto)."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive integer nor auto") from None


def positive_float(text: str) -> float:
    """A number above 0 (nan refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def fraction(text: str) -> float:
    """A share: above 0, at most 1."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} is a share: at most 1")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0 (a temperature)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of at least 0")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds above 0 (--header-timeout): unlike positive_float, inf is refused,
    since a timeout of inf is no bound at all."""
    value = positive_float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds")
    return value


def parse_size(text: str) -> int:
    """A byte count like 4096, 4K, 256KB, 1.5M or 2GiB (binary units: K, M, G, T)."""
    part = text.strip().lower()
    part = part[:-2] if part.endswith("ib") else part.rstrip("b")
    mult = _UNITS.get(part[-1:], 1)
    number = part[:-1] if part[-1:] in _UNITS else part
    try:
        value = float(number) * mult
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # 'x', 'inf', 1e400
        raise argparse.ArgumentTypeError(f"bad size {text.strip()!r}; use e.g. 4K, 256M, 2G")
    return int(value)


def positive_size(text: str) -> int:
    """parse_size, at least one byte (--kv-cache-memory, --max-body-bytes)."""
    try:
        value = parse_size(text)
    except argparse.ArgumentTypeError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive byte count (e.g. 1048576, 512K, 16M)")
    return value


def size_list(text: str) -> list[int]:
    """Comma-separated positive sizes: 4K,256K,4M."""
    return [positive_size(part) for part in text.split(",")]


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: a free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 0..65535")
    return value


def existing_file(text: str) -> str:
    """The path of a file that exists."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def strip_flag(argv: Sequence[str], flag: str) -> list[str]:
    """`argv` without `flag VALUE` / `flag=VALUE` (to re-run a command with some of its flags)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


# --scheduling-policy (engine/prompt_order.py): which prompt takes a step's budget first; under
# shortest-prompt, a prompt that has waited --prompt-max-wait-ms goes in arrival order
SCHEDULING_POLICIES = ("fcfs", "shortest-prompt")
DEFAULT_PROMPT_MAX_WAIT_S = 2.0

# --itl-target-ms auto: a step beside decodes may take twice a decode-only step, and never less than
# AUTO_FLOOR_S, a gap a streaming reader does not see: 200 ms is 5 tokens a second, about 4 words,
# which is reading speed. On a CPU a decode step is short next to a prompt chunk; a lower floor cut
# prompts into slivers, each paying the step's decodes and fixed cost again, and TTFT paid for all
# of them (docs/benchmarks.md, "The floor: 200 ms")
AUTO_FACTOR = 2.0
AUTO_FLOOR_S = 0.2


def parse_itl_target(text) -> Optional[tuple[str, float]]:
    """--itl-target: 'auto' (AUTO_FACTOR times the decode-only step, at least AUTO_FLOOR_S), 'Nx' (N
    times it), a number of milliseconds, or 'off' / None -> None. Returns ('auto', factor), ('x',
    factor) or ('ms', milliseconds)."""
    if text is None:
        return None
    word = str(text).strip().lower()
    if word in ("off", "none", ""):
        return None
    if word == "auto":
        return ("auto", AUTO_FACTOR)
    kind, number = ("x", word[:-1]) if word.endswith("x") else ("ms", word.removesuffix("ms"))
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"--itl-target {text!r}: expected auto, off, a multiple of the decode step such as 2x, "
            f"or milliseconds such as 50"
        ) from None
    if not math.isfinite(value) or (kind == "x" and value <= 1) or (kind == "ms" and value <= 0):
        need = "above 1 (a multiple of the decode-only step)" if kind == "x" else "a positive number of milliseconds"
        raise ValueError(f"--itl-target {text!r}: must be {need}")
    return (kind, value)


def parse_ladder_residual(text) -> Union[str, tuple[int, int], None]:
    """--ladder-residual: 'all' (every decoder layer), 'FIRST:LAST' (layers FIRST..LAST, both
    included, counted from 0) or 'off' (none, whatever config.json says); None: as config.json says.
    Returns 'all', 'off', (FIRST, LAST) or None. The layer count is checked when the model is known."""
    if text is None:
        return None
    word = str(text).strip().lower()
    if word in ("all", "off"):
        return word
    first, sep, last = word.partition(":")
    try:
        if not sep:
            raise ValueError
        span = (int(first), int(last))
    except ValueError:
        raise ValueError(
            f"--ladder-residual {text!r}: expected all, off, or FIRST:LAST (decoder layers, "
            f"both included, counted from 0), such as 8:31"
        ) from None
    if span[0] < 0 or span[1] < span[0]:
        raise ValueError(f"--ladder-residual {text!r}: need 0 <= FIRST <= LAST")
    return span


# --num-speculative-tokens' ceiling (engine/speculative/config.py): past it a miss costs more rows than a hit saves
MAX_SPECULATIVE_TOKENS = 16


def speculative_tokens(text: str) -> int:
    """--num-speculative-tokens: an integer in 1..MAX_SPECULATIVE_TOKENS."""
    value = positive_int(text)
    if value > MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"{value} is more than {MAX_SPECULATIVE_TOKENS}")
    return value

"""Stand-in C compilers for kernels/build.py's tests: shell scripts that log each run (the output
path they were given, one line a run) and then fail, hang, or make the library, by copying a real
build or by running the real compiler."""

from __future__ import annotations

from pathlib import Path

_OUTPUT = 'out=""; prev=""\nfor a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'


def fake_compiler(directory: Path, name: str, action: str, log: Path) -> tuple[str, ...]:
    """A compiler command whose every run appends its `-o` path to `log`, then runs `action` (sh,
    with $out the output path and "$@" the arguments)."""
    script = directory / name
    script.write_text(f"#!/bin/sh\n{_OUTPUT}echo \"$out\" >> '{log}'\n{action}\n")
    script.chmod(0o755)
    return (str(script),)


def copying_compiler(directory: Path, log: Path, library: str, delay_s: float = 0.0) -> tuple[str, ...]:
    """'Compiles' by copying an already built `library` to the output, after `delay_s`."""
    return fake_compiler(directory, "copying-cc", f"sleep {delay_s}\ncp '{library}' \"$out\"", log)


def failing_compiler(directory: Path, log: Path, complaint: str, delay_s: float = 0.0) -> tuple[str, ...]:
    """Fails with `complaint` on stderr, after `delay_s`."""
    return fake_compiler(directory, "failing-cc", f"sleep {delay_s}\necho '{complaint}' >&2\nexit 1", log)


def hanging_compiler(directory: Path, log: Path, pid_file: Path) -> tuple[str, ...]:
    """Never finishes: a child `sleep` (its pid in `pid_file`) holds it, as cc1 would hold cc."""
    return fake_compiler(directory, "hanging-cc", f"sleep 600 &\necho $! > '{pid_file}'\nwait", log)


def counting_compiler(directory: Path, log: Path, real: str = "cc", delay_s: float = 0.0) -> tuple[str, ...]:
    """The real compiler, each run logged, after `delay_s` (a window for the others to arrive in)."""
    return fake_compiler(directory, "counting-cc", f'sleep {delay_s}\nexec {real} "$@"', log)


def runs(log: Path) -> list[str]:
    """The output paths of the runs logged so far."""
    return log.read_text().split() if log.exists() else []

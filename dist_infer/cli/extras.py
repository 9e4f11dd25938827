"""The optional dependencies a command needs (pyproject's extras), checked before it starts."""

from __future__ import annotations

import importlib.util
from typing import Sequence


def need(modules: Sequence[str], extra: str, command: str) -> None:
    """Exit with the pip line to run when any of `modules` is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"dist-infer {command}: needs {', '.join(missing)}: pip install 'dist_infer[{extra}]'")

"""Another `dist-infer` command as a child job, its `--json` line read back.

The bench's one-process peer, calibrate's measuring jobs and every run of a sweep start
`python -m dist_infer ...` this way: outside any launcher's environment (the child starts its
own ranks) and without OMP_NUM_THREADS, so the child's launcher gives its ranks the cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Sequence

from dist_infer.topology.discovery import without_launcher_env


class SubcommandError(RuntimeError):
    """A child command failed, timed out or printed no JSON; the message holds the end of its output."""


def run_json(args: Sequence[str], timeout: float) -> dict:
    """Run `dist-infer *args` (give it --json) and return the JSON object of its last stdout line."""
    cmd = [sys.executable, "-m", "dist_infer", *args]
    env = without_launcher_env(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SubcommandError(f"dist-infer {' '.join(args)}: no result within {timeout:.0f} s") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SubcommandError(
            f"dist-infer {' '.join(args)} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}"
        )
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        raise SubcommandError(f"dist-infer {' '.join(args)}: its last line is not JSON: {lines[-1][:200]!r}") from None

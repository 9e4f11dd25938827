"""glibc malloc tuning (engine/malloc_tuning.py), in fresh interpreters: applied once per process, and
switched off by DIST_INFER_MALLOC_TUNING=0."""

from __future__ import annotations

import os
import subprocess
import sys


def test_malloc_tuning_applies_once_and_can_be_switched_off():
    code = "from dist_infer.engine.malloc_tuning import tune_malloc; import ctypes; print(tune_malloc(), tune_malloc())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    off = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "DIST_INFER_MALLOC_TUNING": "0"},
    )
    assert on.stdout.split() == ["True", "True"]  # glibc on Linux: the thresholds are raised
    assert off.stdout.split() == ["False", "False"]

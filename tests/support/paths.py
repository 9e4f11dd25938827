"""Where things are, for the tests and the processes they start."""

from __future__ import annotations

import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent  # tests/support, the package tests.support
TESTS = SUPPORT.parent
REPO = TESTS.parent
JOBS = SUPPORT / "jobs"  # scripts the tests run as processes (ranks of a job, a client, the netns ssh stand-in)
VENV_BIN = REPO / ".venv" / "bin" if (REPO / ".venv" / "bin").is_dir() else Path(sys.executable).parent

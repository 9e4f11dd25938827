"""The launcher's process loop (launch.launcher.run) on real processes: one rank failing stops the
others, and its exit code is the job's."""

from __future__ import annotations

import sys

from dist_infer.launch.launcher import Proc, run


def test_run_stops_every_rank_when_one_fails():
    """A job's ranks share a communicator: one failing stops the rest, and its code is the job's."""
    sleeper = Proc("rank 0", [sys.executable, "-c", "import time; time.sleep(120)"], {"RANK": "0"})
    failing = Proc("rank 1", [sys.executable, "-c", "raise SystemExit(3)"], {"RANK": "1"})
    assert run([sleeper, failing], poll_s=0.01) == 3
    ok = Proc("rank 0", [sys.executable, "-c", "pass"], {"RANK": "0"})
    assert run([ok, ok], poll_s=0.01) == 0

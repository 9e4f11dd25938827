"""Forks ranks from a fresh, single-threaded process, as a launcher does, and prints what happened
as one JSON line (tests/integration/test_forked_ranks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dist_infer.launch.forked_start import RankForker, thread_count
from dist_infer.launch.launcher import Proc, run

ENV_CHECK = "import os, sys; sys.exit(0 if os.environ.get('FORK_MARK') == 'seen' else 5)"


def main() -> None:
    out: dict = {"threads_before": thread_count()}
    forker = RankForker()  # the ranks' real modules: torch and the engine
    out["ready"] = forker.ready()
    out["threads_after_preload"] = thread_count()
    # a forked `dist-infer launch` whose one rank is a plain Python checking the environment it was given
    seen = forker.fork(["launch", "--", sys.executable, "-c", ENV_CHECK], {"FORK_MARK": "seen"})
    out["env_code"] = seen.wait(timeout=120)
    missing = forker.fork(["launch", "--", sys.executable, "-c", ENV_CHECK], {})
    out["no_env_code"] = missing.wait(timeout=120)
    out["bad_command_code"] = forker.fork(["no-such-command"], {}).wait(timeout=120)
    sleeper = forker.fork(["launch", "--", sys.executable, "-c", "import time; time.sleep(60)"], {})
    try:
        sleeper.wait(timeout=0.2)
        out["timeout_raised"] = False
    except subprocess.TimeoutExpired:
        out["timeout_raised"] = True
    os.killpg(sleeper.pid, 9)  # its own session: the group is the rank and what it started
    out["killed_code"] = sleeper.wait(timeout=60)
    # the launcher's own loop over forked ranks: the first failure is the job's code
    ok = [
        Proc(f"rank {i}", [sys.executable, "-m", "dist_infer", "launch", "--", sys.executable, "-c", "0"])
        for i in range(2)
    ]
    out["run_ok"] = run(ok)
    out["run_failing"] = run([*ok, Proc("rank 2", [sys.executable, "-m", "dist_infer", "no-such-command"])])
    print(json.dumps(out))


if __name__ == "__main__":
    main()

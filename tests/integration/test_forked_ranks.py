"""Local ranks forked from a launcher that imported torch once (dist_infer/launch/forked_start.py),
on real processes: forked from a fresh single-threaded process, a child sees the environment it
was given, exits with its command's code, and is watched as a Popen would be; and a real job
gives the same tokens whether its ranks were forked or exec'd."""

from __future__ import annotations

import json
import sys

from tests.support.paths import JOBS
from tests.support.processes import checkout_env, run, venv_exe


def test_ranks_forked_from_a_fresh_process_behave_as_exec_started_ones():
    proc = run([sys.executable, str(JOBS / "forked_ranks_job.py")], 240, env=checkout_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # numpy's BLAS pool is kept from starting in the launcher, so it stays forkable with torch loaded
    assert out["threads_before"] == 1 and out["ready"] and out["threads_after_preload"] == 1, out
    assert out["env_code"] == 0 and out["no_env_code"] == 5, out  # the rank's environment is its own
    assert out["bad_command_code"] == 2, out
    assert out["timeout_raised"] and out["killed_code"] == -9, out
    assert out["run_ok"] == 0 and out["run_failing"] == 2, out


def test_generate_gives_the_same_tokens_with_forked_and_exec_ranks():
    args = [
        venv_exe("dist-infer"),
        "generate",
        "--tp",
        "2",
        "--pp",
        "2",
        "--nproc",
        "4",
        "--json",
        "--prompt",
        "The three primary colors are",
        "--max-new-tokens",
        "6",
        "--no-eos-stop",
    ]
    outs = {}
    for method in ("fork", "exec"):
        proc = run(args, 240, env={**checkout_env(), "DIST_INFER_RANK_START": method})
        assert proc.returncode == 0, (method, proc.stderr[-4000:])
        # the launcher says at INFO when it cannot fork; the default run must not have had to
        assert "local ranks start by exec" not in proc.stderr, proc.stderr[-2000:]
        outs[method] = json.loads(proc.stdout.strip().splitlines()[-1])
    ids = {m: [r["token_ids"] for r in o["outputs"]] for m, o in outs.items()}
    assert ids["fork"] == ids["exec"] and len(ids["fork"][0]) == 6, ids
    bad = run(args, 120, env={**checkout_env(), "DIST_INFER_RANK_START": "spawn"})
    assert bad.returncode == 2 and "DIST_INFER_RANK_START='spawn'" in bad.stderr, bad.stderr[-2000:]

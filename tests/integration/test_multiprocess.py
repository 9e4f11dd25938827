"""Real multi-process jobs on this machine: every launcher, failures that must end the job fast,
and bad input that must be refused with a clear message."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from dist_infer.topology import free_port
from tests.support.paths import JOBS
from tests.support.processes import COMM_TEST_FAST, assert_comm_test_ok, run

MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]
JOB_TIMEOUT = 180  # a healthy job takes ~5 s here; this only bounds a hang
FAIL_FAST_S = 15.0


# -- healthy jobs, every launcher ---------------------------------------------------------


def test_torchrun():
    cmd = [
        "torchrun",
        "--nproc-per-node",
        "4",
        "--master-port",
        str(free_port()),
        "--no-python",
        "dist-infer",
        "comm-test",
        "--tp",
        "2",
        "--pp",
        "2",
        *COMM_TEST_FAST,
    ]
    assert_comm_test_ok(run(cmd, JOB_TIMEOUT), 4, "gloo")


@pytest.mark.parametrize("backend", ["auto", "mpi"])
def test_mpirun(backend):
    # auto: gloo, with the master address and port broadcast by rank 0 through MPI
    cmd = [*MPIRUN, "-np", "4", "dist-infer", "comm-test", "--tp", "2", "--pp", "2", *COMM_TEST_FAST]
    if backend != "auto":
        cmd += ["--backend", backend]
    result = run(cmd, JOB_TIMEOUT)
    assert_comm_test_ok(result, 4, "gloo" if backend == "auto" else "mpi")
    assert "via openmpi" in result.stderr


def test_launch_local():
    cmd = [
        "dist-infer",
        "launch",
        "--nproc-per-node",
        "4",
        "--",
        "dist-infer",
        "comm-test",
        "--tp",
        "2",
        "--pp",
        "2",
        *COMM_TEST_FAST,
    ]
    result = run(cmd, JOB_TIMEOUT)
    summary = assert_comm_test_ok(result, 4, "gloo")
    groups = {r["group"] for r in summary["results"]}
    assert groups == {"world", "tp", "pp"}
    ops = {r["op"] for r in summary["results"]}
    assert ops == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "broadcast",
        "send_recv",
        "batch_p2p",
        "barrier",
    }


def test_launch_through_mpirun():
    cmd = [
        "dist-infer",
        "launch",
        "--launcher",
        "mpirun",
        "--nproc-per-node",
        "2",
        "--",
        "dist-infer",
        "comm-test",
        "--backend",
        "mpi",
        *COMM_TEST_FAST,
    ]
    assert_comm_test_ok(run(cmd, JOB_TIMEOUT), 2, "mpi")


def test_launch_dry_run_prints_plan():
    result = run(
        [
            "dist-infer",
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            "1234",
            "--dry-run",
            "--",
            "dist-infer",
            "comm-test",
        ],
        60,
    )
    assert result.returncode == 0
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2
    assert "RANK=1" in lines[1] and "MASTER_PORT=1234" in lines[1] and lines[1].endswith("dist-infer comm-test")


def test_python_m_help():
    result = run([sys.executable, "-m", "dist_infer", "--help"], 60)
    assert result.returncode == 0
    assert "launch" in result.stdout and "comm-test" in result.stdout


LAUNCHER_SIDE = textwrap.dedent("""
    import sys
    from dist_infer.cli.parser import build_parser
    from dist_infer.cli.cp_auto import resolve_cp_auto
    from dist_infer.launch.launcher import relaunch_as_local_ranks
    from dist_infer.launch.rank import spawn_local, world_needed
    from dist_infer.models.builtin import resolve_model
    for argv in (["generate", "--tp", "2", "--nproc", "2"], ["bench", "--pp", "2"], ["serve", "--instances", "2"],
                 ["plan", "--gpus", "2"], ["launch", "--", "true"]):
        args = build_parser().parse_args(argv)
        if hasattr(args, "cp"):
            resolve_cp_auto(args, argv, 16)
            world_needed(args)
    resolve_model("tiny")
    print(sorted(m for m in ("torch", "transformers", "fastapi") if m in sys.modules))
""")


def test_the_launcher_side_imports_no_torch():
    """What a command runs before it starts its ranks (every command's flags, the model's path,
    the layout, the instances) loads without torch: with `--nproc N` the process that only starts
    and watches the ranks would otherwise spend ~1.5 s of a core importing it, before every job."""
    from dist_infer.models.tiny_model import ensure_tiny_model

    ensure_tiny_model()  # written (with torch) here, so the check below only finds it
    result = run([sys.executable, "-c", LAUNCHER_SIDE], 60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


# -- a failing rank ends the job quickly, naming it ---------------------------------------

SLEEPERS = textwrap.dedent("""
    import os, sys, time
    if os.environ["RANK"] == "1":
        time.sleep(1)
        print(f"DIED AT {time.time()}", file=sys.stderr, flush=True)
        sys.exit(7)
    time.sleep(120)
""")


def seconds_since_death(result) -> float:
    """From the failing rank's `DIED AT <time>` line on stderr to the end of the job."""
    match = re.search(r"DIED AT ([0-9.]+)", result.stderr)
    assert match, "the failing rank did not report its death"
    return result.ended_at - float(match.group(1))


def test_launch_fails_fast_naming_the_rank():
    result = run(["dist-infer", "launch", "--nproc-per-node", "3", "--", sys.executable, "-c", SLEEPERS], 60)
    assert result.returncode == 7
    assert seconds_since_death(result) < FAIL_FAST_S, f"job ended {seconds_since_death(result):.1f} s after the failure"
    assert "rank 1" in result.stderr and "exit code 7" in result.stderr


def test_launch_rank_dies_mid_job():
    cmd = ["dist-infer", "launch", "--nproc-per-node", "3", "--", sys.executable, str(JOBS / "dying_rank.py")]
    result = run(cmd, 100)  # survivors hang for 120 s: only the launcher can end the job in time
    assert result.returncode == 3
    assert seconds_since_death(result) < FAIL_FAST_S, f"job ended {seconds_since_death(result):.1f} s after the failure"
    assert "rank 2" in result.stderr and "exit code 3" in result.stderr


@pytest.mark.parametrize("backend", ["auto", "mpi"])
def test_mpirun_rank_dies_mid_job(backend):
    cmd = [*MPIRUN, "-np", "3", sys.executable, str(JOBS / "dying_rank.py"), backend]
    result = run(cmd, 100)  # survivors hang for 120 s (their comm timeout is 60 s): mpirun must end them
    assert result.returncode != 0
    assert seconds_since_death(result) < FAIL_FAST_S, f"job ended {seconds_since_death(result):.1f} s after the failure"


# -- bad input -----------------------------------------------------------------------------


def test_tp_not_dividing_world():
    result = run(
        [
            "dist-infer",
            "launch",
            "--nproc-per-node",
            "4",
            "--",
            "dist-infer",
            "comm-test",
            "--tp",
            "3",
            "--timeout",
            "60",
        ],
        55,
    )
    # refused before any rendezvous: a hang would last the 60 s comm timeout, past run's 55 s
    assert result.returncode != 0
    assert "tp=3" in result.stderr
    assert "does not divide the world size 4" in result.stderr
    assert "4 % 3 = 1" in result.stderr


def test_malformed_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nnode-a slots=2\nnode-b slots=two\n")
    result = run(["dist-infer", "launch", "--hostfile", str(hostfile), "--", "true"], 60)
    assert result.returncode == 2
    assert f"{hostfile}:3" in result.stderr
    assert "slots must be a positive integer" in result.stderr


def test_node_rank_outside_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1 slots=1\n")
    result = run(["dist-infer", "launch", "--hostfile", str(hostfile), "--node-rank", "1", "--", "true"], 60)
    assert result.returncode == 2
    assert "--node-rank 1 is outside the hostfile's 1 hosts" in result.stderr


def test_launch_without_command():
    result = run(["dist-infer", "launch", "--nproc-per-node", "2"], 60)
    assert result.returncode == 2
    assert "nothing to launch" in result.stderr


def test_launch_missing_program():
    result = run(["dist-infer", "launch", "--nproc-per-node", "2", "--", "/nonexistent/prog"], 60)
    assert result.returncode == 127
    assert "cannot start" in result.stderr

"""The suite's zygote (tests/support/zygote.py) runs a `dist-infer` command as exec would: the same
output and exit code, its streams, directory and environment, signals forwarded, and a command whose
client is killed is killed with everything it started."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from tests.support.paths import VENV_BIN
from tests.support.polling import wait_until
from tests.support.processes import end_tree, finish, start, venv_env
from tests.support.zygote import CLIENT, SWITCH_ENV, command

DIST = str(VENV_BIN / "dist-infer")
GENERATE = [DIST, "generate", "--nproc", "2", "--max-new-tokens", "6", "--json"]


def _through_zygote(cmd, env) -> bool:
    wrapped = command(cmd, env)
    return wrapped != list(map(str, cmd)) and str(CLIENT) in wrapped


def _token_ids(stdout: str) -> list[list[int]]:
    return [out["token_ids"] for out in json.loads(stdout.splitlines()[-1])["outputs"]]


def _exec_env() -> dict[str, str]:
    return venv_env({SWITCH_ENV: "off"})


def test_a_forked_command_prints_and_exits_as_the_execd_one(tmp_path):
    env = venv_env()
    assert _through_zygote(GENERATE, env), "the zygote did not take a plain dist-infer command"
    forked = finish(start(GENERATE, env), timeout=120)
    execd = finish(start(GENERATE, _exec_env()), timeout=120)
    assert forked.returncode == execd.returncode == 0, forked.stderr[-3000:]
    assert _token_ids(forked.stdout) == _token_ids(execd.stdout)
    refused = [DIST, "generate", "--prompt-ids", "1,2,x"]  # `raise SystemExit(message)`: printed, exit 1
    forked, execd = finish(start(refused, env), timeout=60), finish(start(refused, _exec_env()), timeout=60)
    assert forked.returncode == execd.returncode == 1
    assert (
        forked.stderr.splitlines()[-1]
        == execd.stderr.splitlines()[-1]
        == "dist-infer generate: --prompt-ids '1,2,x' must be comma-separated integers"
    )
    missing = [DIST, "generate", "--model", str(tmp_path / "no-such-model")]
    forked, execd = finish(start(missing, env), timeout=60), finish(start(missing, _exec_env()), timeout=60)
    assert forked.returncode == execd.returncode != 0
    assert "no-such-model" in forked.stderr and "no-such-model" in execd.stderr


def test_the_command_gets_the_tests_environment_and_directory(tmp_path):
    env = venv_env({"DIST_INFER_ZYGOTE_PROBE": "seen"})
    # a rank command the launcher runs as given: it reports what the forked launcher passed down
    probe = [sys.executable, "-c", "import os; print(os.environ.get('DIST_INFER_ZYGOTE_PROBE'), os.getcwd())"]
    cmd = [DIST, "launch", "--nproc-per-node", "1", "--", *probe]
    assert _through_zygote(cmd, env)
    result = finish(start(cmd, env, cwd=tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"seen {tmp_path}" in result.stdout


def test_a_signal_reaches_the_command_and_its_end_is_the_clients(tmp_path):
    cmd = [DIST, "launch", "--nproc-per-node", "1", "--", "sleep", "60"]
    proc = start(cmd, venv_env())
    try:
        pids = _descendant_sleeps(wait_for=1)
        proc.send_signal(signal.SIGTERM)  # the launcher stops its rank and exits non-zero, as exec'd
        code = proc.wait(timeout=60)
        assert code != 0
        wait_until(lambda: not any(_alive(p) for p in pids), timeout=30, what="the rank ended with its launcher")
    finally:
        end_tree(proc)


def test_a_killed_client_takes_its_command_and_ranks_with_it():
    proc = start([DIST, "launch", "--nproc-per-node", "2", "--", "sleep", "60"], venv_env())
    try:
        pids = _descendant_sleeps(wait_for=2)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        wait_until(lambda: not any(_alive(p) for p in pids), timeout=30, what="the ranks ended with the client")
    finally:
        end_tree(proc)


def test_an_environment_that_changes_imports_starts_by_exec(tmp_path):
    assert not _through_zygote(GENERATE, venv_env({"PYTHONPATH": str(tmp_path)}))
    assert not _through_zygote(GENERATE, venv_env({"LD_PRELOAD": "libnothing.so"}))
    assert not _through_zygote(GENERATE, _exec_env())
    assert not _through_zygote(["torchrun", "--nproc-per-node", "2", DIST, "generate"], venv_env())
    assert _through_zygote([sys.executable, "-m", "dist_infer", "generate"], venv_env({"OMP_NUM_THREADS": "2"}))


def _sleeps() -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"sleep", b"60"]:
            found.append(int(name))
    return found


def _descendant_sleeps(wait_for: int) -> list[int]:
    """The `sleep 60` ranks started since the test began (no other test runs them)."""
    deadline = time.monotonic() + 60
    while len(pids := _sleeps()) < wait_for:
        if time.monotonic() > deadline:
            pytest.fail(f"{wait_for} sleep rank(s) did not start")
        time.sleep(0.1)
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False

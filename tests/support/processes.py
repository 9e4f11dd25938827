"""Running processes from the tests: every subprocess gets a timeout; on timeout its whole process
tree is ended (TERM first, so a launcher can stop its ranks, then KILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Mapping, Optional, Sequence

import pytest

from dist_infer.topology.discovery import without_launcher_env
from tests.support.paths import REPO, VENV_BIN


def venv_env(extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """A copy of os.environ with the venv's bin first on PATH and no launcher variables."""
    env = without_launcher_env(os.environ)  # tests start their own jobs: nothing may leak in from an outer one
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update(extra)
    return env


def checkout_env() -> dict[str, str]:
    """venv_env with this checkout first on sys.path: the venv's console scripts (and mpirun's ranks)
    would otherwise import the package its editable install points at, which need not be this tree."""
    return venv_env({"PYTHONPATH": str(REPO)})


def venv_exe(name: str) -> str:
    """The venv's `name` (dist-infer, mpirun), else the one on PATH."""
    import shutil

    path = VENV_BIN / name
    return str(path) if path.exists() else (shutil.which(name) or name)


@pytest.fixture(scope="module")
def one_torch_thread():
    """In-process references (HF's tiny matmuls) in one thread beside a job's ranks: intra-op threads
    competing with the ranks for a few cores make them many times slower. A test module takes it with
    `from tests.support.processes import one_torch_thread` and `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _show(cmd, proc_out: str, proc_err: str, why: str) -> None:
    print(f"--- {why}: {cmd}")
    print("--- stdout (tail):\n" + (proc_out or "")[-6000:])
    print("--- stderr (tail):\n" + (proc_err or "")[-6000:])


def end_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """TERM the process group (a launcher forwards it to its ranks), then KILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            if sig == signal.SIGTERM:
                # the leader is gone; KILL any straggler left in its group
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        except subprocess.TimeoutExpired:
            continue


def start(cmd: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd=REPO) -> subprocess.Popen:
    """Start `cmd` in its own process group, output captured (use `finish` to collect it). A
    `dist-infer` command is forked from the suite's zygote (tests/support/zygote.py)."""
    from tests.support.zygote import command

    env = dict(env) if env is not None else venv_env()
    return subprocess.Popen(
        command(cmd, env),
        env=env,
        cwd=str(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for `proc` at most `timeout` seconds; fail the test (with its output) on timeout."""
    cmd = " ".join(proc.args) if isinstance(proc.args, list) else proc.args
    start_t = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_tree(proc)
        out, err = proc.communicate()
        _show(cmd, out, err, f"TIMED OUT after {timeout} s")
        pytest.fail(f"command timed out after {timeout} s: {cmd}")
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    result.elapsed = time.monotonic() - start_t  # type: ignore[attr-defined]
    result.ended_at = time.time()  # type: ignore[attr-defined]
    if proc.returncode != 0:
        _show(cmd, out, err, f"exit {proc.returncode} after {result.elapsed:.1f} s")  # type: ignore[attr-defined]
    return result


def run(
    cmd: Sequence[str], timeout: float, env: Optional[Mapping[str, str]] = None, cwd=REPO
) -> subprocess.CompletedProcess:
    """Run `cmd` to completion (at most `timeout` s); stdout/stderr are printed if it fails.

    The result has two extra attributes: `elapsed` (seconds) and `ended_at` (time.time() at exit).
    """
    return finish(start(cmd, env, cwd), timeout)


def last_json(stdout: str) -> dict:
    """The JSON object on the last non-empty stdout line (what `comm-test --json` prints on rank 0)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "no output on stdout"
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise AssertionError(f"last stdout line is not JSON: {lines[-1][:300]!r}") from exc


def assert_comm_test_ok(result: subprocess.CompletedProcess, world_size: int, backend: Optional[str] = None) -> dict:
    assert result.returncode == 0, f"exit code {result.returncode}"
    summary = last_json(result.stdout)
    assert summary["ok"] is True
    assert summary["world_size"] == world_size
    if backend is not None:
        assert summary["backend"] == backend
    assert summary["results"] and all(r["ok"] for r in summary["results"])
    return summary


# Small and quick: what every multi-process comm-test in this suite runs.
COMM_TEST_FAST = ["--json", "--sizes", "4K,64K", "--iters", "3", "--timeout", "60"]

"""Processes of one node building the native kernels at once (kernels/build.py): one compiles,
the others wait on its lock and load what it built. The compiler is the real one, each run logged."""

from __future__ import annotations

import shutil
import sys
import time

import pytest

from tests.support.fake_compilers import counting_compiler, runs
from tests.support.paths import JOBS
from tests.support.processes import checkout_env, finish, start

PROCESSES = 3


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) to build the kernels with")
def test_processes_building_at_once_compile_once(tmp_path):
    log, cache, go = tmp_path / "runs.log", tmp_path / "cache", tmp_path / "go"
    (cc,) = counting_compiler(tmp_path, log, delay_s=2)  # they all ask well within it
    ready = [tmp_path / f"ready{i}" for i in range(PROCESSES)]
    procs = [start([sys.executable, JOBS / "kernel_build_job.py", cache, cc, r, go], checkout_env()) for r in ready]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    go.touch()
    results = [finish(p, timeout=300) for p in procs]
    assert [r.returncode for r in results] == [0] * PROCESSES
    libraries = {line.split()[1] for r in results for line in r.stdout.splitlines() if line.startswith("LIBRARY")}
    assert len(libraries) == 1 and len(runs(log)) == 1  # one compile, every process loads it
    assert sum("waiting for another process" in r.stderr for r in results) >= 1  # the build was shared, not missed
    assert sorted(p.suffix for p in cache.iterdir()) == [".lock", ".so"]  # no temporary file left

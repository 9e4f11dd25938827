"""Ring attention as real multi-process jobs: tests/support/jobs/ring_attention_job.py under
`dist-infer launch` for cp 2, 3 and 4 (and mpirun with the MPI backend), each rank checking its
rows against single-rank fp64 attention; and a rank that raises mid-ring must end the job instead
of hanging it. (The pure parts in process: tests/unit/parallel/ring/, one test file per module.)
"""

from __future__ import annotations

import sys

import pytest

from tests.support.paths import JOBS
from tests.support.processes import run

JOB = JOBS / "ring_attention_job.py"
JOB_TIMEOUT = 180  # a healthy job takes 10-20 s on 2 cores; this only bounds a hang
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_job(cp):
    result = run(["dist-infer", "launch", "--nproc-per-node", str(cp), "--", sys.executable, str(JOB)], JOB_TIMEOUT)
    assert result.returncode == 0
    assert f"ring-attention job ok: cp={cp}, 52 ring runs checked" in result.stdout


def test_ring_job_mpi_backend():
    result = run([*MPIRUN, "-np", "3", sys.executable, str(JOB), "--backend", "mpi", "--quick"], JOB_TIMEOUT)
    assert result.returncode == 0
    assert "ring-attention job ok: cp=3, 20 ring runs checked, backend mpi" in result.stdout


def test_rank_raising_mid_ring_ends_the_job():
    # cp rank 1 raises at its second ring transfer while ranks 0 and 2 wait inside the ring with a
    # 300 s comm timeout: only the launcher ending the job can finish this within JOB_TIMEOUT.
    result = run(
        [
            "dist-infer",
            "launch",
            "--nproc-per-node",
            "3",
            "--",
            sys.executable,
            str(JOB),
            "--fail-at-step",
            "2",
            "--quick",
        ],
        JOB_TIMEOUT,
    )
    assert result.returncode != 0
    assert "injected failure at ring transfer 2 on cp rank 1" in result.stderr
    assert "ring-attention job ok" not in result.stdout


def test_rank_raising_mid_ring_aborts_mpi():
    result = run(
        [*MPIRUN, "-np", "2", sys.executable, str(JOB), "--backend", "mpi", "--fail-at-step", "1", "--quick"],
        JOB_TIMEOUT,
    )
    assert result.returncode != 0
    assert "injected failure at ring transfer 1 on cp rank 1" in result.stderr

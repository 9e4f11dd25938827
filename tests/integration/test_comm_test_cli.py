"""`comm-test` as a job of one: the CLI in a process of its own, no launcher, on each backend."""

from __future__ import annotations

import sys

import pytest

from tests.support.processes import COMM_TEST_FAST, assert_comm_test_ok, run


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_comm_test_single_process(backend):
    result = run([sys.executable, "-m", "dist_infer", "comm-test", "--backend", backend, *COMM_TEST_FAST], timeout=120)
    assert_comm_test_ok(result, 1, backend)

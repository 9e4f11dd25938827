"""serve --placement ray's pure part: which addresses keep Ray on the loopback, and that a value the
user set is kept (tests/integration/test_ray_placed_serving.py runs the placement on a real Ray cluster,
without the variable in its environment)."""

from __future__ import annotations

import os
import subprocess

import pytest

from dist_infer.serving.placement.ray_placement import RAY_CLUSTER_ENV, RayInstanceJob, _host_of, keep_ray_on_loopback


@pytest.mark.parametrize(
    "address, host",
    [
        ("127.0.0.1:6379", "127.0.0.1"),
        ("localhost:6379", "localhost"),
        ("[::1]:6379", "::1"),
        ("::1", "::1"),
        ("ray://127.0.0.1:10001", "127.0.0.1"),
        ("10.0.0.5:6379", "10.0.0.5"),
        ("auto", "auto"),
        ("head", "head"),
    ],
)
def test_host_of_a_ray_address(address, host):
    assert _host_of(address) == host


@pytest.mark.parametrize("address", ["127.0.0.1:6379", "localhost:6379", "[::1]:6379", "ray://127.0.0.1:10001"])
def test_a_loopback_cluster_keeps_ray_on_the_loopback(monkeypatch, address):
    monkeypatch.delenv(RAY_CLUSTER_ENV, raising=False)
    keep_ray_on_loopback(address)
    assert os.environ[RAY_CLUSTER_ENV] == "0"


@pytest.mark.parametrize("address", ["10.0.0.5:6379", "auto", "ray://head.example:10001"])
def test_other_clusters_are_left_alone(monkeypatch, address):
    monkeypatch.delenv(RAY_CLUSTER_ENV, raising=False)
    keep_ray_on_loopback(address)
    assert RAY_CLUSTER_ENV not in os.environ


def test_the_users_value_is_kept(monkeypatch):
    monkeypatch.setenv(RAY_CLUSTER_ENV, "1")
    keep_ray_on_loopback("127.0.0.1:6379")
    assert os.environ[RAY_CLUSTER_ENV] == "1"


class _FakeRayJob(RayInstanceJob):
    """A Ray job whose runner answers from a script (no Ray): `polls` is what poll() reads in turn."""

    def __init__(self, polls):
        super().__init__(None, None, "node-1", 3)
        self.polls, self.waits = list(polls), []

    def _call(self, method, *args, timeout):
        if method == "poll":
            return self.polls.pop(0) if self.polls else None
        self.waits.append(args[0])
        return None


def test_a_ray_job_s_wait_returns_its_exit_code_once_polled():
    job = _FakeRayJob([None, None, 0])
    assert job.wait() == 0 and job.waits == [1.0, 1.0], "no timeout: waits of a second each"
    assert _FakeRayJob([None, 7]).wait(timeout=30.0) == 7


def test_a_ray_job_s_wait_times_out_like_popen():
    job = _FakeRayJob([])
    with pytest.raises(subprocess.TimeoutExpired, match="instance 3 on Ray node node-1"):
        job.wait(timeout=0.05)
    assert job.waits and all(0 < w <= 0.05 for w in job.waits), "each wait at most what is left"

"""serve --placement ray's pure part: which addresses keep Ray on the loopback, and that a value the
user set is kept (tests/integration/test_ray_placed_serving.py runs the placement on a real Ray cluster,
without the variable in its environment)."""

from __future__ import annotations

import os

import pytest

from dist_infer.serving.placement.ray_placement import RAY_CLUSTER_ENV, _host_of, keep_ray_on_loopback


@pytest.mark.parametrize("address, host", [("127.0.0.1:6379", "127.0.0.1"), ("localhost:6379", "localhost"),
                                           ("[::1]:6379", "::1"), ("::1", "::1"), ("ray://127.0.0.1:10001", "127.0.0.1"),
                                           ("10.0.0.5:6379", "10.0.0.5"), ("auto", "auto"), ("head", "head")])
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

"""Instances placed by Ray (serve --placement ray), as real jobs on a real Ray cluster of several
nodes on this host: a head with no CPUs and three worker nodes of one CPU each, every node on
127.0.0.1 (ray.cluster_utils.Cluster), so each tp=1 instance fills a node.

Two instances land on two nodes; the node under one is removed mid-stream (its raylet, its actors
and the jobs they own die with it): every request ends exactly as it does alone (greedy = HF), the
dead instance is placed again on the free node (--auto-restart, on by default under Ray), and every
live instance's KV blocks are free at the end. Then a node is added and the admin API scales up onto
it, and stops (drains) an instance.

Neither the cluster nor the serve job has RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER in its environment: the
serve job sets it itself (serving/placement/ray_placement.py) before it first imports Ray, as a user runs it.
"""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf, prompts_for
from tests.support.processes import checkout_env, run, venv_env
from tests.support.serving_helpers import (
    ServerJob,
    assert_live_blocks_free,
    instances,
    run_async,
    stream_tokens,
    wait_state,
    where_if_running,
)

ray = pytest.importorskip(
    "ray", reason="Ray is an optional extra (pip install 'dist_infer[ray]'); make test installs it"
)

LONG = 100
HF_CHECKED = 30
LOCAL = "127.0.0.1"
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # what keeps Ray on the loopback; never set by the tests


def without_ray_cluster_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k != RAY_CLUSTER_ENV}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint(
        tmp_path_factory.mktemp("ray"), "llama-gqa", max_position_embeddings=1024, num_hidden_layers=2
    )


@pytest.fixture
def cluster(monkeypatch):
    from ray.cluster_utils import Cluster

    monkeypatch.delenv(RAY_CLUSTER_ENV, raising=False)  # the nodes' processes must not have it either
    c = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": LOCAL, "include_dashboard": False}
    )
    for _ in range(3):
        c.add_node(num_cpus=1, node_ip_address=LOCAL)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()


def _node(cluster, node_id: str):
    return next(n for n in cluster.list_all_nodes() if n.node_id == node_id)


def test_ray_stays_on_the_loopback_without_the_variable_in_the_environment():
    """Ray reads the variable when it is imported: placement_ray sets it before, and Ray's driver
    then keeps 127.0.0.1 instead of swapping in the host's outward address."""
    probe = (
        "from dist_infer.serving.placement.ray_placement import keep_ray_on_loopback\n"
        "keep_ray_on_loopback('127.0.0.1:6379')\n"
        "import ray\n"
        "from ray._private import ray_constants, services\n"
        "print(ray_constants.ENABLE_RAY_CLUSTER, services.resolve_ip_for_localhost('127.0.0.1'))\n"
    )
    result = run([sys.executable, "-c", probe], timeout=120, env=without_ray_cluster_env(checkout_env()))
    assert result.returncode == 0 and result.stdout.split() == ["False", LOCAL], result.stdout


@pytest.mark.timeout(900)  # a Ray cluster, two instances and a restart: minutes beside other work
def test_ray_places_instances_and_a_lost_node_loses_no_request(checkpoint, cluster, tmp_path):
    env = without_ray_cluster_env(venv_env())
    args = [
        "--model",
        checkpoint,
        "--instances",
        "tp1,tp1",
        "--kv-blocks",
        "120",
        "--migrate-interval",
        "0",
        "--dispatch",
        "rr",
        "--timeout",
        "180",  # also how long an instance may take to join: Ray starting its process and torch beside other work
        "--placement",
        "ray",
        "--ray-address",
        cluster.address,
    ]
    with ServerJob(tmp_path, args, env=env) as job:
        insts = instances(job)
        workers = {n.node_id for n in cluster.list_all_nodes() if n is not cluster.head_node}
        placed = [i["node"] for i in insts]
        assert set(placed) <= workers and placed[0] != placed[1], (placed, workers)

        async def go():
            async with httpx.AsyncClient() as client:
                removed = {}

                async def remove_at(request_id, n):
                    if n >= 20 and not removed:
                        removed["on"] = where_if_running(job, request_id)
                        if removed["on"] is None:  # the client reads behind: it ended already
                            return
                        # rr put it on instance 1 unless a busy machine made 1 miss a turn: its node goes
                        await asyncio.get_running_loop().run_in_executor(
                            None, cluster.remove_node, _node(cluster, placed[removed["on"]])
                        )

                tasks = []
                for i, p in enumerate(prompts):  # rr: 0 -> instance 0, 1 -> instance 1, 2 -> instance 0
                    tasks.append(
                        asyncio.create_task(
                            stream_tokens(client, job.url, p, remove_at if i == 1 else None, max_tokens=LONG)
                        )
                    )
                    await asyncio.sleep(0.1)
                during = await asyncio.gather(*tasks)
                alone = [await stream_tokens(client, job.url, p, max_tokens=LONG) for p in prompts]
                return removed, during, alone

        for seed in (71, 72, 73):  # a round whose request ended before the removal runs again, new prompts
            prompts = prompts_for([12, 19, 7], seed=seed)
            removed, during, alone = run_async(go())
            if removed.get("on") is not None:
                break
        else:
            pytest.fail(f"three rounds in a row ended before the node could be removed: {removed}")
        for i, (d, a) in enumerate(zip(during, alone)):
            assert d["error"] is None and d["token_ids"] == a["token_ids"] and len(d["token_ids"]) == LONG, (i, d, a)
        assert_ids_match_hf(checkpoint, prompts, [d["token_ids"] for d in during], HF_CHECKED, "a Ray node lost")
        on = removed["on"]
        lost = placed[on]
        again = wait_state(job, on, "serving")
        assert again["node"] in workers - {lost}, (again, lost)
        assert again["node"] != instances(job)[1 - on]["node"] and again["restarts"] == 1, instances(job)
        metrics = job.metrics()
        assert metrics["dist_infer:requests_lost_total"] == 0 and metrics["dist_infer:instance_failures_total"] == 1
        assert_live_blocks_free(job)

        fresh = cluster.add_node(num_cpus=1, node_ip_address=LOCAL)
        r = httpx.post(job.url + "/admin/instances", json={"layout": "tp1"}, timeout=60)
        assert r.status_code == 202, r.text
        added = wait_state(job, 2, "serving")
        assert added["node"] == fresh.node_id, (added, fresh.node_id)
        r = httpx.post(job.url + "/admin/instances/2/stop", timeout=30)
        assert r.status_code == 202, r.text
        wait_state(job, 2, "stopped")
        assert_live_blocks_free(job)
        assert job.stop() == 0, job.log()[-4000:]

"""A two-host job on one machine: two network namespaces joined by a veth pair stand in for two
hosts, each with its own address, interfaces and port space. Traffic only ever goes to the
namespaces' 10.231.X.{1,2} addresses and loopback.

Needs root (or CAP_NET_ADMIN) for `ip netns add`; skipped, with the reason, where that fails.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from types import SimpleNamespace

import pytest

from tests.support.paths import JOBS, REPO, VENV_BIN
from tests.support.processes import COMM_TEST_FAST, assert_comm_test_ok, finish, run, start, venv_env

JOB_TIMEOUT = 180
_counter = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts(tmp_path):
    """Namespaces NS_A (10.231.X.1) and NS_B (10.231.X.2) on one /24, and a hostfile of both."""
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    pid, k = os.getpid(), next(_counter)
    x = (pid + 17 * k) % 250 + 1
    names = [f"dist-infer-test-{pid}-{k}-{side}" for side in "ab"]
    veths = [f"dv{pid % 100000}{k % 10}{side}" for side in "ab"]  # interface names: 15 chars at most
    addrs = [f"10.231.{x}.1", f"10.231.{x}.2"]
    created: list[str] = []

    def cleanup() -> None:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        # a veth still in the root namespace (set-up failed half way) goes with its peer
        subprocess.run(["ip", "link", "del", veths[0]], capture_output=True, timeout=30)

    try:
        for name in names:
            _ip("netns", "add", name)
            created.append(name)
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for name, veth, addr in zip(names, veths, addrs):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        cleanup()
        pytest.skip(f"cannot build the two-namespace network ({' '.join(exc.cmd)}): {exc.stderr.strip()}")
    except Exception:
        cleanup()
        raise

    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# two namespaces, two ranks each\n{addrs[0]} slots=2\n{addrs[1]} slots=2\n")
    try:
        yield SimpleNamespace(names=names, addrs=addrs, hostfile=hostfile)
    finally:
        cleanup()
        leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
        assert not any(name in leftover for name in names), f"namespaces left behind: {leftover}"


@pytest.mark.parametrize("layout", [[], ["--tp", "4", "--shm", "socket"]], ids=["tp1", "tp4-own-links"])
def test_each_node_started_by_hand(two_hosts, layout):
    """`dist-infer launch --hostfile HF --node-rank K` run on each "host", concurrently; then a tp
    group across both hosts over its own TCP links (comm/socket_links.py: the namespaces share a
    host name, so `auto` would find one node), every op checked."""
    dist_infer = str(VENV_BIN / "dist-infer")
    procs = [
        start(
            [
                "ip",
                "netns",
                "exec",
                ns,
                dist_infer,
                "launch",
                "--hostfile",
                two_hosts.hostfile,
                "--node-rank",
                str(k),
                "--",
                "dist-infer",
                "comm-test",
                *COMM_TEST_FAST,
                *layout,
            ]
        )
        for k, ns in enumerate(two_hosts.names)
    ]
    try:
        results = [finish(p, JOB_TIMEOUT) for p in procs]
    finally:
        for p in procs:  # if one failed the test, do not leave the other running
            if p.poll() is None:
                p.kill()
                p.wait()
    for k, result in enumerate(results):
        assert result.returncode == 0, f"node {k} exited {result.returncode}"
    assert_comm_test_ok(results[0], 4, "gloo")
    # each node chose the interface that reaches the master, not lo
    assert "using network interface dv" in results[0].stderr
    assert "using network interface dv" in results[1].stderr


def test_ssh_fanout_through_namespaces(two_hosts):
    """`dist-infer launch --hostfile HF --ssh-command ...` from the root namespace starts both nodes."""
    mapping = " ".join(f"{addr}={ns}" for addr, ns in zip(two_hosts.addrs, two_hosts.names))
    env = venv_env({"NETNS_SSH_MAP": mapping})
    ssh = os.path.relpath(JOBS / "netns_ssh.sh", REPO)
    assert ssh == "tests/support/jobs/netns_ssh.sh"
    result = run(
        [
            "dist-infer",
            "launch",
            "--hostfile",
            two_hosts.hostfile,
            "--ssh-command",
            ssh,
            "--",
            "dist-infer",
            "comm-test",
            *COMM_TEST_FAST,
        ],
        JOB_TIMEOUT,
        env=env,
    )
    assert_comm_test_ok(result, 4, "gloo")
    assert "launch node 0" in result.stderr and "launch node 1" in result.stderr


def test_netns_ssh_helper_refuses_unknown_host():
    env = venv_env({"NETNS_SSH_MAP": "10.231.0.1=nowhere"})
    result = run([str(JOBS / "netns_ssh.sh"), "10.231.0.9", "true"], 30, env=env)
    assert result.returncode == 255
    assert "no namespace for host '10.231.0.9'" in result.stderr


def test_live_migration_between_instances_on_two_hosts(two_hosts, tmp_path):
    """`serve --instances 2` with one instance per "host": a request moved mid-decode from one host's
    instance to the other's (its KV over the veth) streams on with exactly its unmoved tokens."""
    import json
    import signal

    from tests.support.checkpoints import write_hf_checkpoint
    from tests.support.hf_compare import prompts_for

    ckpt = write_hf_checkpoint(
        tmp_path,
        "llama-gqa",
        max_position_embeddings=1024,
        hidden_size=384,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1536,
        num_hidden_layers=4,
    )
    hostfile = tmp_path / "hosts1"
    hostfile.write_text(f"{two_hosts.addrs[0]} slots=1\n{two_hosts.addrs[1]} slots=1\n")
    ready = tmp_path / "ready.json"
    dist_infer = str(VENV_BIN / "dist-infer")
    serve = [
        "serve",
        "--model",
        str(ckpt),
        "--instances",
        "2",
        "--kv-blocks",
        "64",
        "--migrate-interval",
        "0",
        "--timeout",
        "60",
        "--port",
        "0",
        "--ready-file",
        str(ready),
    ]
    procs = [
        start(
            [
                "ip",
                "netns",
                "exec",
                ns,
                dist_infer,
                "launch",
                "--hostfile",
                hostfile,
                "--node-rank",
                str(k),
                "--",
                "dist-infer",
                *serve,
            ]
        )
        for k, ns in enumerate(two_hosts.names)
    ]
    try:
        prompt = ",".join(map(str, prompts_for([24], seed=9)[0]))
        client = run(
            [
                "ip",
                "netns",
                "exec",
                two_hosts.names[0],
                str(VENV_BIN / "python"),
                str(JOBS / "migrate_client.py"),
                str(ready),
                prompt,
                "300",
            ],
            JOB_TIMEOUT,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        out = json.loads(client.stdout.strip().splitlines()[-1])
        procs[0].send_signal(signal.SIGTERM)
        results = [finish(p, JOB_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert out["migration"]["outcome"] == "ok" and out["migration"]["blocks"] > 0, out["migration"]
    assert out["moved"] == out["alone"] and len(out["moved"]) == 300
    assert all(i["free_blocks"] == i["total_blocks"] for i in out["instances"]), out["instances"]
    for k, result in enumerate(results):
        assert result.returncode == 0, f"node {k} exited {result.returncode}: {result.stderr[-3000:]}"


def test_a_request_outlives_its_host_with_its_kv_mirror(two_hosts, tmp_path):
    """`serve --instances 2 --kv-mirror buddy`, one instance per "host": a request on host B's instance
    is mirrored over the veth into host A's, B's ranks are SIGKILLed mid-decode, and the stream goes
    on at A from the mirror (computing again only its unmirrored tail) with exactly its tokens alone."""
    import json

    from tests.support.checkpoints import write_hf_checkpoint

    ckpt = write_hf_checkpoint(tmp_path, "llama-gqa", max_position_embeddings=1024, num_hidden_layers=4)
    hostfile = tmp_path / "hosts1"
    hostfile.write_text(f"{two_hosts.addrs[0]} slots=1\n{two_hosts.addrs[1]} slots=1\n")
    ready = tmp_path / "ready.json"
    serve = ["serve", "--model", str(ckpt), "--instances", "2", "--kv-blocks", "128", "--kv-mirror", "buddy"]
    serve += ["--migrate-interval", "0", "--timeout", "60", "--port", "0", "--ready-file", str(ready)]
    procs = [
        start(
            ["ip", "netns", "exec", ns, str(VENV_BIN / "dist-infer"), "launch", "--hostfile", hostfile]
            + ["--node-rank", str(k), "--", "dist-infer", *serve]
        )
        for k, ns in enumerate(two_hosts.names)
    ]
    try:
        prompt = ",".join(str((7 * i + 3) % 120 + 2) for i in range(160))  # the vocabulary is 128
        client = run(
            ["ip", "netns", "exec", two_hosts.names[0], str(VENV_BIN / "python")]
            + [str(JOBS / "mirror_failover_client.py"), str(ready), prompt, "300"],
            JOB_TIMEOUT,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        out = json.loads(client.stdout.strip().splitlines()[-1])
        procs[0].send_signal(signal.SIGTERM)
        result = finish(procs[0], JOB_TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert out["killed"], "the request ended before its mirror was seen caught up"
    assert out["migration"] is None or out["migration"]["outcome"] == "ok", out["migration"]
    assert out["chaos"] == out["alone"] and len(out["chaos"]) == 300
    survivor = out["instances"][0]["kv_mirror"]
    assert survivor["blocks_received"] + survivor["blocks_already_held"] >= 10, survivor  # (held: it ran there first)
    assert 0 < survivor["failover_recomputed_tokens"] < 160, survivor
    assert out["instances"][0]["free_blocks"] == out["instances"][0]["total_blocks"], out["instances"][0]
    assert result.returncode == 0, f"host A's node exited {result.returncode}: {result.stderr[-3000:]}"

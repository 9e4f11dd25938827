"""The launcher's plans (pure functions: what `dist-infer launch` would start, as --dry-run shows):
per-rank environments, hostfiles, torchrun / mpirun / ssh command lines, and their errors."""

from __future__ import annotations

import os
import shlex
import sys

import pytest

from dist_infer.launch.launcher import (
    LaunchError,
    LaunchOptions,
    Proc,
    describe_exit,
    plan,
    plan_local,
)
from dist_infer.topology.cores import threads_per_rank
from dist_infer.topology.discovery import DEFAULT_MASTER_PORT
from dist_infer.topology.hostfile import Host
from tests.support.paths import VENV_BIN

# -- plans -------------------------------------------------------------------------------------

H2 = [Host("10.0.0.1", 2), Host("10.0.0.2", 2)]
H_UNEQUAL = [Host("10.0.0.1", 2), Host("10.0.0.2", 3), Host("10.0.0.3", 1)]


@pytest.fixture
def venv_path(monkeypatch):
    """The venv's bin first on PATH, so `mpirun`/`torchrun` resolve as they would for a user."""
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def test_plan_local_env_per_rank(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    procs = plan(LaunchOptions(command=["prog", "--x"], nproc_per_node=3))
    assert [p.label for p in procs] == ["rank 0", "rank 1", "rank 2"]
    port = procs[0].env["MASTER_PORT"]
    assert int(port) > 0
    for i, p in enumerate(procs):
        assert p.argv == ["prog", "--x"]
        assert p.env["RANK"] == str(i) and p.env["LOCAL_RANK"] == str(i)
        assert p.env["WORLD_SIZE"] == "3" and p.env["LOCAL_WORLD_SIZE"] == "3"
        assert p.env["GROUP_RANK"] == "0"
        assert p.env["MASTER_ADDR"] == "127.0.0.1" and p.env["MASTER_PORT"] == port
        assert p.env["OMP_NUM_THREADS"] == str(threads_per_rank(3))
        assert "GLOO_SOCKET_IFNAME" not in p.env


def test_plan_local_keeps_user_omp_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    procs = plan(LaunchOptions(command=["p"], nproc_per_node=2, master_port=1234))
    assert all("OMP_NUM_THREADS" not in p.env for p in procs)
    assert all(p.env["MASTER_PORT"] == "1234" for p in procs)


def test_threads_per_rank():
    assert threads_per_rank(4, cpus=16) == 4
    assert threads_per_rank(3, cpus=2) == 1
    assert threads_per_rank(1, cpus=2) == 2
    assert threads_per_rank(0, cpus=8) == 8


def test_plan_local_hostfile_node_rank_offsets():
    opts = LaunchOptions(command=["p"], hosts=H_UNEQUAL, hostfile="hf", node_rank=1)
    procs = plan(opts)
    assert [p.env["RANK"] for p in procs] == ["2", "3", "4"]
    assert [p.env["LOCAL_RANK"] for p in procs] == ["0", "1", "2"]
    for p in procs:
        assert p.env["WORLD_SIZE"] == "6" and p.env["LOCAL_WORLD_SIZE"] == "3" and p.env["GROUP_RANK"] == "1"
        assert p.env["MASTER_ADDR"] == "10.0.0.1"  # first host
        assert p.env["MASTER_PORT"] == str(DEFAULT_MASTER_PORT)  # nodes agree without talking
    last = plan(
        LaunchOptions(
            command=["p"], hosts=H_UNEQUAL, hostfile="hf", node_rank=2, master_addr="127.0.0.1", master_port=4000
        )
    )
    assert [p.env["RANK"] for p in last] == ["5"]
    assert last[0].env["GROUP_RANK"] == "2" and last[0].env["MASTER_ADDR"] == "127.0.0.1"
    assert last[0].env["MASTER_PORT"] == "4000"
    assert last[0].env["GLOO_SOCKET_IFNAME"] == "lo"  # the interface that reaches the master


def test_plan_local_iface_forced():
    procs = plan(LaunchOptions(command=["p"], nproc_per_node=2, iface="eth9"))
    assert all(p.env["GLOO_SOCKET_IFNAME"] == "eth9" and p.env["NCCL_SOCKET_IFNAME"] == "eth9" for p in procs)


@pytest.mark.parametrize("node_rank", [2, 5, -1])
def test_node_rank_outside_hostfile(node_rank):
    with pytest.raises(LaunchError, match=rf"--node-rank {node_rank} is outside the hostfile's 2 hosts \(0\.\.1\)"):
        plan(LaunchOptions(command=["p"], hosts=H2, hostfile="hf", node_rank=node_rank))


def test_ssh_fanout_needs_the_hostfile_it_passes_on():
    with pytest.raises(LaunchError, match="hostfile"):
        plan(LaunchOptions(command=["p"], hosts=H2))  # each node is told --hostfile: hosts alone are not enough


def test_plan_local_with_hosts_needs_node_rank():
    with pytest.raises(LaunchError):
        plan_local(LaunchOptions(command=["p"], hosts=H2, node_rank=None), 1)


def test_plan_torchrun_local(venv_path):
    procs = plan(
        LaunchOptions(command=["dist-infer", "comm-test"], nproc_per_node=4, launcher="torchrun", master_port=1234)
    )
    assert len(procs) == 1
    argv = procs[0].argv
    assert os.path.basename(argv[0]) == "torchrun"
    assert argv[1:] == [
        "--nnodes=1",
        "--node-rank=0",
        "--nproc-per-node=4",
        "--master-addr=127.0.0.1",
        "--master-port=1234",
        "--no-python",
        "dist-infer",
        "comm-test",
    ]


def test_plan_torchrun_hostfile_node(venv_path):
    procs = plan(LaunchOptions(command=["x"], hosts=H2, hostfile="hf", node_rank=1, launcher="torchrun"))
    assert procs[0].label == "torchrun node 1"
    assert procs[0].argv[1:] == [
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=2",
        "--master-addr=10.0.0.1",
        f"--master-port={DEFAULT_MASTER_PORT}",
        "--no-python",
        "x",
    ]


def test_plan_torchrun_refuses_unequal_slots():
    with pytest.raises(LaunchError) as info:
        plan(LaunchOptions(command=["x"], hosts=H_UNEQUAL, hostfile="hf", node_rank=0, launcher="torchrun"))
    message = str(info.value)
    assert "same number of ranks" in message
    assert "10.0.0.1=2, 10.0.0.2=3, 10.0.0.3=1" in message


def test_plan_mpirun_local(venv_path):
    procs = plan(LaunchOptions(command=["dist-infer", "comm-test"], nproc_per_node=3, launcher="mpirun"))
    argv = procs[0].argv
    assert os.path.basename(argv[0]) == "mpirun"
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    assert argv[1:] == ["-np", "3", *root, "--oversubscribe", "dist-infer", "comm-test"]


def test_plan_mpirun_host_list(venv_path):
    procs = plan(
        LaunchOptions(
            command=["x", "y"],
            hosts=H_UNEQUAL,
            hostfile="hf",
            launcher="mpirun",
            master_addr="10.0.0.1",
            master_port=4444,
        )
    )
    argv = procs[0].argv
    assert argv[1:3] == ["-np", "6"]
    i = argv.index("--host")
    assert argv[i + 1] == "10.0.0.1:2,10.0.0.2:3,10.0.0.3:1"
    j = argv.index("MASTER_ADDR=10.0.0.1")
    assert argv[j - 1] == "-x" and argv[j + 1 : j + 3] == ["-x", "MASTER_PORT=4444"]
    assert argv[-2:] == ["x", "y"]


def test_plan_mpirun_rejects_node_rank(venv_path):
    with pytest.raises(LaunchError, match="drop --node-rank"):
        plan(LaunchOptions(command=["x"], hosts=H2, hostfile="hf", node_rank=0, launcher="mpirun"))


def test_plan_mpirun_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="mpirun not found"):
        plan(LaunchOptions(command=["x"], nproc_per_node=2, launcher="mpirun"))


def test_plan_ssh_fanout(tmp_path):
    hostfile = tmp_path / "hosts"
    opts = LaunchOptions(
        command=["dist-infer", "comm-test", "--tp", "2"],
        hosts=H2,
        hostfile=str(hostfile),
        ssh_command="tests/support/jobs/netns_ssh.sh",
        iface="veth0",
    )
    procs = plan(opts)
    assert [p.label for p in procs] == ["node 0 (10.0.0.1)", "node 1 (10.0.0.2)"]
    for k, (p, host) in enumerate(zip(procs, H2)):
        assert p.env == {}
        assert p.argv[:2] == ["tests/support/jobs/netns_ssh.sh", host.name]
        assert len(p.argv) == 3
        line = p.argv[2]
        assert line.startswith(f"cd {shlex.quote(os.getcwd())} && exec ")
        remote = shlex.split(line.split(" && exec ", 1)[1])
        assert remote == [
            sys.executable,
            "-m",
            "dist_infer",
            "launch",
            "--hostfile",
            str(hostfile),
            "--node-rank",
            str(k),
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            str(DEFAULT_MASTER_PORT),
            "--launcher",
            "local",
            "--iface",
            "veth0",
            "--",
            "dist-infer",
            "comm-test",
            "--tp",
            "2",
        ]


def test_plan_ssh_command_with_options(tmp_path):
    opts = LaunchOptions(
        command=["true"],
        hosts=H2,
        hostfile=str(tmp_path / "h"),
        ssh_command="ssh -p 2222 -o BatchMode=yes",
        master_port=3000,
        master_addr="10.0.0.9",
    )
    procs = plan(opts)
    assert procs[1].argv[:5] == ["ssh", "-p", "2222", "-o", "BatchMode=yes"]
    assert procs[1].argv[5] == "10.0.0.2"
    assert "--master-addr 10.0.0.9 --master-port 3000" in procs[1].argv[6]


def test_plan_ssh_hostfile_made_absolute(monkeypatch, tmp_path):
    (tmp_path / "hf").write_text("a\nb\n")
    monkeypatch.chdir(tmp_path)
    procs = plan(LaunchOptions(command=["true"], hosts=[Host("a", 1), Host("b", 1)], hostfile="hf"))
    assert f"--hostfile {tmp_path / 'hf'}" in procs[0].argv[-1]


def test_unknown_launcher():
    with pytest.raises(LaunchError, match="unknown launcher"):
        plan(LaunchOptions(command=["x"], launcher="srun"))


def test_proc_shell_and_describe_exit():
    p = Proc("rank 0", ["echo", "a b"], {"B": "2", "A": "x y"})
    assert p.shell() == "A='x y' B=2 echo 'a b'"
    assert Proc("r", ["true"]).shell() == "true"
    assert describe_exit(7) == "exit code 7"
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(-15) == "signal SIGTERM"

"""serve --placement slurm's pure parts: where it refuses, the srun of a step, the step's environment
(tests/integration/test_slurm.py runs them on a one-host Slurm)."""

from __future__ import annotations

import sys

import pytest

from dist_infer.serving.fleet.instance_specs import InstanceSpec
from dist_infer.serving.placement.slurm_placement import (
    SlurmPlacementError,
    check_allocation,
    hub_host,
    srun_command,
    step_env,
)
from dist_infer.serving.placement.spawn import HUB_FILE_ENV, HUB_KEY_ENV

ALLOC = {
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NTASKS": "4",
    "SLURM_CONF": "/etc/x.conf",
    "PATH": "/usr/bin",
}


def test_refused_outside_an_allocation():
    with pytest.raises(SlurmPlacementError, match="no \\$SLURM_JOB_ID.*sbatch.*salloc"):
        check_allocation({"PATH": "/usr/bin"})


def test_refused_without_srun(tmp_path):
    with pytest.raises(SlurmPlacementError, match="srun is not on PATH"):
        check_allocation({**ALLOC, "PATH": str(tmp_path)})


def test_refused_as_one_of_several_tasks(tmp_path):
    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    task = {**ALLOC, "PATH": str(tmp_path), "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    with pytest.raises(SlurmPlacementError, match="rank 1 of 2.*run serve once"):
        check_allocation(task)
    assert check_allocation({**task, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == "7"  # srun -n 1 --overlap serve
    assert check_allocation({**ALLOC, "PATH": str(tmp_path), "SLURM_PROCID": "0"}) == "7"  # the batch script


def test_an_instance_is_one_step_on_one_node():
    cmd = srun_command(InstanceSpec(2, 2), "dist-infer-instance-3-1", ["serve", "--join", "h:1"])
    assert cmd[: cmd.index(sys.executable)] == [
        "srun",
        "--nodes",
        "1",
        "--ntasks",
        "4",
        "--exact",
        "--kill-on-bad-exit=1",
        "--job-name",
        "dist-infer-instance-3-1",
    ]
    assert cmd[cmd.index(sys.executable) :] == [sys.executable, "-m", "dist_infer", "serve", "--join", "h:1"]


def test_the_step_keeps_the_allocation_and_drops_this_processes_step_and_rendezvous():
    own_step = {
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "n1",
        "SLURM_SRUN_COMM_PORT": "1",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
        "RANK": "0",
        HUB_FILE_ENV: "/tmp/hub.json",
        "SLURM_CPUS_PER_TASK": "3",
    }
    env = step_env({**ALLOC, **own_step}, b"k3y")
    assert {k: env[k] for k in ALLOC} == ALLOC
    assert not set(own_step) - {"SLURM_CPUS_PER_TASK"} & set(env)
    assert env[HUB_KEY_ENV] == "k3y" and env["OMP_NUM_THREADS"] == "3"
    assert step_env({**ALLOC, "OMP_NUM_THREADS": "1", "SLURM_CPUS_PER_TASK": "3"}, b"k")["OMP_NUM_THREADS"] == "1"


def test_the_hub_stays_on_the_loopback_while_the_allocation_is_this_host(monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "n1.cluster")
    assert hub_host({"SLURM_JOB_NODELIST": "n1"}) == "127.0.0.1"
    monkeypatch.setattr(
        "dist_infer.serving.placement.slurm_placement.local_address_towards", lambda host: f"towards {host}"
    )
    assert hub_host({"SLURM_JOB_NODELIST": "n[1-2]"}) == "towards n2"

"""The front end's own files: the hub key readable by its owner only; and its start-up refusing
an --instances fleet past --max-ranks before any instance starts."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from dist_infer.serving.placement.rank_budget import RankBudget, RankBudgetError, local_capacity
from tests.support.processes import checkout_env


def test_the_hub_key_file_is_private_even_over_an_open_file(tmp_path):
    import os
    import stat

    from dist_infer.cli.serve_frontend import write_private

    path = tmp_path / "hub.key"
    path.write_text("old")
    path.chmod(0o644)
    write_private(str(path), "secret")
    assert path.read_text() == "secret" and stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_serve_refuses_a_start_up_fleet_past_the_budget_before_anything_starts():
    from dist_infer.cli.serve_frontend import rank_capacity_for
    from dist_infer.serving.fleet.instance_specs import InstanceSpec

    args = SimpleNamespace(max_ranks=None, frontend_only=False, autoscale=None, slo=None)
    spawn = SimpleNamespace(rank_capacity=lambda: local_capacity(2))  # a placement that only says what it holds
    with pytest.raises(
        RankBudgetError,
        match=r"^--instances 'tp=2; tp=1' needs 3 ranks; --max-ranks is 2, the "
        r"default: this host's 2 usable cores$",
    ):
        rank_capacity_for(args, spawn, [InstanceSpec(2), InstanceSpec(1)])
    assert rank_capacity_for(args, spawn, [InstanceSpec(2)])().limit == 2, "the placement's, asked at each start"
    args.max_ranks = 3
    assert rank_capacity_for(args, spawn, [InstanceSpec(2), InstanceSpec(1)])() == RankBudget(3)
    args.frontend_only = True  # a launched job's instances run already: nothing to refuse at start-up
    assert rank_capacity_for(args, spawn, [InstanceSpec(4)])().limit == 3


@pytest.mark.parametrize(
    "flags, figure",
    [
        ([], "--max-ranks is {cores}, the default: this host's {cores} usable cores"),
        (["--max-ranks", "8"], "--max-ranks is 8"),
    ],
)
def test_serve_with_a_fleet_past_max_ranks_exits_2_naming_it_and_starts_no_instance(flags, figure):
    from dist_infer.topology.cores import usable_cores

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dist_infer",
            "serve",
            "--model",
            "tiny",
            "--instances",
            "tp=99999",
            "--port",
            "0",
            *flags,
        ],
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"needs 99999 ranks; {figure.format(cores=usable_cores())}" in run.stderr, run.stderr[-3000:]
    assert "instance 0:" not in run.stderr, "no instance's job was started"

"""--max-ranks' pure part (serving/placement/rank_budget.py): the check and its message, each placement's
default capacity, and the --instances parser's cheap refusal of a layout past the bound
(tests/unit/serving/fleet/test_cluster_failover.py checks the admin routes and restarts against a cluster,
test_autoscale_policy.py the autoscaler, tests/unit/cli/test_serve_frontend.py the start-up)."""

from __future__ import annotations

import pytest

from dist_infer.serving.fleet.instance_specs import InstancesError, TooManyRanks, parse_instances
from dist_infer.serving.placement.rank_budget import (
    RankBudget,
    RankBudgetError,
    local_capacity,
    ray_capacity,
    slurm_capacity,
    slurm_cpus,
)


def test_a_start_fits_beside_the_ranks_running_or_is_refused_naming_the_figures():
    budget = RankBudget(8)
    budget.check("layout tp=4", 4, held=4)  # exactly full is allowed
    with pytest.raises(RankBudgetError) as never:
        budget.check("layout tp=99999", 99999, held=3)
    assert str(never.value) == "layout tp=99999 needs 99999 ranks; --max-ranks is 8 (3 running)"
    assert not never.value.ever_fits, "no number of stopped instances makes room for it"
    with pytest.raises(RankBudgetError) as later:
        budget.check("layout tp=2", 2, held=7)
    assert later.value.ever_fits and "(7 running)" in str(later.value)
    with pytest.raises(RankBudgetError, match=r"^--instances 'tp=4; tp=8' needs 12 ranks; --max-ranks is 8$"):
        budget.check("--instances 'tp=4; tp=8'", 12)  # at start-up nothing runs: no count
    assert budget.room(3) == 5 and budget.room(11) == 0


def test_a_default_budget_says_where_it_came_from():
    with pytest.raises(
        RankBudgetError,
        match=r"needs 3 ranks; --max-ranks is 2, the default: this host's 2 usable "
        r"cores \(0 running\)",
    ):
        local_capacity(2).check("layout tp=3", 3, held=0)
    assert local_capacity(0).limit == 1


@pytest.mark.parametrize(
    "resources, cpus, gpus, limit, names",
    [
        ({"CPU": 8.0, "memory": 1e9}, 1, 0, 8, "8 CPUs / 1 per rank"),
        ({"CPU": 8.0}, 3, 0, 2, "8 CPUs / 3 per rank"),
        ({"CPU": 8.0}, 0, 0, 8, "8 CPUs / 1 per rank"),  # a rank that reserves no CPU still runs on one
        ({"CPU": 64.0, "GPU": 4.0}, 1, 1, 4, "4 GPUs / 1 per rank"),  # the scarcer one bounds
        ({"CPU": 2.0, "GPU": 8.0}, 1, 1, 2, "2 CPUs / 1 per rank"),
        ({"CPU": 16.0}, 1, 1, 0, "0 GPUs / 1 per rank"),  # GPU ranks and no GPU: nothing fits, said so
    ],
)
def test_ray_capacity_is_the_clusters_cpus_or_gpus_over_a_ranks(resources, cpus, gpus, limit, names):
    budget = ray_capacity(resources, cpus, gpus)
    assert budget.limit == limit and names in budget.origin, budget


@pytest.mark.parametrize(
    "text, total", [("8", 8), ("36(x2),72", 144), ("4(x3)", 12), ("", None), ("x", None), ("4,(x2)", None)]
)
def test_slurm_cpus_per_node_reads(text, total):
    assert slurm_cpus(text) == total


def test_slurm_capacity_is_the_allocations_cpus_over_each_tasks():
    assert slurm_capacity({"SLURM_JOB_CPUS_PER_NODE": "3"}).limit == 3
    both = {"SLURM_JOB_CPUS_PER_NODE": "8(x2)", "SLURM_CPUS_PER_TASK": "4"}
    assert slurm_capacity(both).limit == 4 and "16 CPUs / 4 per task" in slurm_capacity(both).origin
    assert slurm_capacity({**both, "SRUN_CPUS_PER_TASK": "2"}).limit == 8, "what srun's steps take wins"
    assert slurm_capacity({**both, "SLURM_CPUS_PER_TASK": "zero"}).limit == 16
    assert slurm_capacity({"SLURM_JOB_ID": "7"}) is None, "the allocation does not say: the caller falls back"


def test_the_parser_refuses_a_layout_past_the_bound_before_reading_on():
    with pytest.raises(TooManyRanks, match=r"^--instances 'tp=99999' needs 99999 ranks; --max-ranks is 8$") as one:
        parse_instances("tp=99999", max_ranks=8)
    assert one.value.ranks == 99999
    # it stops at the item that passes the bound: the bad item after it is never read
    with pytest.raises(TooManyRanks, match="needs 12 or more ranks") as first:
        parse_instances("tp=4; tp=8; bogus!", max_ranks=8)
    assert first.value.ranks == 12
    with pytest.raises(TooManyRanks, match="needs 3072 ranks"):
        parse_instances("1024", tp=3, max_ranks=8)  # a count: the product, before the list is made
    assert len(parse_instances("tp=4; tp=4", max_ranks=8)) == 2 and parse_instances("tp=99999")[0].size == 99999


def test_the_parser_refuses_a_long_or_absurd_text_unread():
    long = "tp1," * 4_000_000  # a 16 MB body: refused by its length, not split into four million items
    with pytest.raises(InstancesError, match="16000000 characters") as err:
        parse_instances(long, max_ranks=8)
    assert len(str(err.value)) < 600, "the message quotes the start of the text, not all of it"
    with pytest.raises(InstancesError, match="from 1 to 1024 instances"):
        parse_instances("9" * 5000)  # past int()'s digit limit: an InstancesError, not a ValueError from int
    with pytest.raises(InstancesError, match=r"item 'tp=1(,pp=1){5}': .*pp is given twice"):
        parse_instances("tp=1," + "pp=1," * 1000 + "pp=1")  # an item grows to one part per axis (and one), no further

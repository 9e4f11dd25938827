"""Rank discovery from every launcher's environment variables, and the MPI fallbacks."""

from __future__ import annotations

import pytest

from dist_infer.topology.discovery import (
    DEFAULT_MASTER_PORT,
    DiscoveryError,
    RankInfo,
    discover,
    expand_slurm_nodelist,
    needs_mpi,
    resolve_with_mpi,
)

# -- torchrun (and `dist-infer launch`) ----------------------------------------------------


def test_torchrun_all_variables():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29555",
    }
    info = discover(env)
    assert info == RankInfo(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29555,
        launcher="torchrun",
    )
    assert info.num_nodes == 2
    assert not needs_mpi(info)


def test_torchrun_env_roundtrip():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "1234",
    }
    assert discover(env).env() == env


def test_torchrun_derives_local_rank_and_node_from_local_world():
    info = discover({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (info.local_rank, info.node_rank, info.local_world_size) == (1, 1, 4)
    assert info.master_addr is None and info.master_port is None


def test_torchrun_minimal_is_one_node():
    info = discover({"RANK": "2", "WORLD_SIZE": "3"})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.node_rank) == (2, 3, 2, 3, 0)


def test_torchrun_node_rank_fallback():
    info = discover({"RANK": "6", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "3"})
    assert info.node_rank == 3


# -- MPI implementations -------------------------------------------------------------------


def test_openmpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
    }
    info = discover(env)
    assert info == RankInfo(3, 4, 1, 2, 1, None, None, "openmpi")
    assert needs_mpi(info)  # nobody set a rendezvous: rank 0 must broadcast one through MPI


def test_openmpi_node_rank_derived_and_master_taken():
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "6",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
        "MASTER_ADDR": "10.1.1.1",
        "MASTER_PORT": "4000",
    }
    info = discover(env)
    assert info.node_rank == 1
    assert (info.master_addr, info.master_port) == ("10.1.1.1", 4000)
    assert not needs_mpi(info)


def test_mpich_pmi():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    assert discover(env) == RankInfo(2, 4, 0, 2, 1, None, None, "mpich")


def test_mvapich2():
    env = {
        "MV2_COMM_WORLD_RANK": "7",
        "MV2_COMM_WORLD_SIZE": "8",
        "MV2_COMM_WORLD_LOCAL_RANK": "3",
        "MV2_COMM_WORLD_LOCAL_SIZE": "4",
    }
    info = discover(env)
    assert info == RankInfo(7, 8, 3, 4, 1, None, None, "mvapich2")
    assert needs_mpi(info)


# -- Slurm ---------------------------------------------------------------------------------


def test_slurm_srun():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NODELIST": "gpu[07-09,12]",
    }
    info = discover(env)
    assert info == RankInfo(5, 8, 1, 2, 2, "gpu07", DEFAULT_MASTER_PORT, "slurm")
    assert not needs_mpi(info)


def test_slurm_master_is_first_host_of_mixed_list_and_port_kept():
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "login3,gpu[01-02]",
        "MASTER_PORT": "31000",
    }
    info = discover(env)
    assert (info.master_addr, info.master_port) == ("login3", 31000)


def test_slurm_explicit_master_wins_over_nodelist():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]", "MASTER_ADDR": "10.9.9.9"}
    assert discover(env).master_addr == "10.9.9.9"


def test_slurm_tasks_per_node():
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "a,b",
    }
    info = discover(env)
    assert (info.local_world_size, info.num_nodes, info.master_addr) == (2, 2, "a")


# What srun 22.05 leaves in a task of a step on part of a two-node allocation, and in the batch script.
_STEP = {
    "SLURM_JOB_ID": "41",
    "SLURM_STEP_ID": "3",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NODELIST": "n[1-2]",
    "SLURM_STEP_NODELIST": "n2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_TASKS_PER_NODE": "2",
}
_BATCH = {
    "SLURM_JOB_ID": "41",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
}


def test_slurm_step_meets_on_its_own_first_node_with_its_own_task_counts():
    info = discover(_STEP)
    assert (info.rank, info.world_size, info.local_world_size, info.num_nodes) == (1, 2, 2, 1)
    assert info.master_addr == "n2"  # not the allocation's first node, where this step has no rank


def test_slurm_steps_side_by_side_get_ports_of_their_own():
    from dist_infer.topology.discovery import slurm_port

    ports = {discover({**_STEP, "SLURM_STEP_ID": str(step)}).master_port for step in range(50)}
    assert len(ports) == 50 and all(20000 <= p < 30000 for p in ports)
    assert discover({**_STEP, "MASTER_PORT": "31000"}).master_port == 31000
    assert slurm_port({}) == DEFAULT_MASTER_PORT


@pytest.mark.parametrize("step", [None, "4294967294", "batch"])
def test_slurm_batch_script_is_no_rank(step):
    """sbatch's script has SLURM_PROCID=0 and SLURM_NTASKS=4 but is no rank of 4: the script that
    runs srun (or a front end) would otherwise wait for three ranks that never come."""
    env = dict(_BATCH) if step is None else {**_BATCH, "SLURM_STEP_ID": step}
    assert discover(env) is None
    assert discover({**_BATCH, "SLURM_STEP_ID": "0"}).world_size == 4


# -- precedence and errors -----------------------------------------------------------------

_SLURM_ALLOC = {
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_NNODES": "2",
}


def test_mpirun_inside_slurm_allocation_is_openmpi():
    env = {
        **_SLURM_ALLOC,
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    info = discover(env)
    assert info.launcher == "openmpi"
    assert (info.rank, info.world_size) == (3, 4)


def test_mpich_inside_slurm_allocation_is_mpich():
    env = {**_SLURM_ALLOC, "PMI_RANK": "1", "PMI_SIZE": "2"}
    assert discover(env).launcher == "mpich"


def test_torchrun_inside_slurm_allocation_is_torchrun():
    env = {**_SLURM_ALLOC, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    assert discover(env).launcher == "torchrun"


def test_empty_env_is_none():
    assert discover({}) is None
    assert not needs_mpi(None)


def test_unrelated_env_is_none():
    assert discover({"HOME": "/root", "PATH": "/bin", "RANK": "0"}) is None  # RANK without WORLD_SIZE


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "4", "WORLD_SIZE": "4"},
        {"RANK": "-1", "WORLD_SIZE": "4"},
        {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"},
        {"PMI_RANK": "9", "PMI_SIZE": "3"},
        {"MV2_COMM_WORLD_RANK": "8", "MV2_COMM_WORLD_SIZE": "8"},
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "5"},
    ],
    ids=["torchrun", "torchrun-negative", "openmpi", "mpich", "mvapich2", "slurm"],
)
def test_rank_outside_world(env):
    with pytest.raises(DiscoveryError, match="outside world size"):
        discover(env)


def test_zero_world():
    with pytest.raises(DiscoveryError, match="not positive"):
        discover({"RANK": "0", "WORLD_SIZE": "0"})


def test_local_rank_outside_local_world():
    with pytest.raises(DiscoveryError, match="local rank 2 is outside local world size 2"):
        discover({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    "env,name",
    [
        ({"RANK": "one", "WORLD_SIZE": "4"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "4.0"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "4", "MASTER_PORT": "http"}, "MASTER_PORT"),
        ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
        ({"PMI_RANK": "0", "PMI_SIZE": "two"}, "PMI_SIZE"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "?"}, "SLURM_LOCALID"),
    ],
)
def test_non_integer_values_name_the_variable(env, name):
    with pytest.raises(DiscoveryError, match=rf"{name}=.* is not an integer"):
        discover(env)


# -- Slurm host lists ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "nodelist,hosts",
    [
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("x[1,3],y[2-3]", ["x1", "x3", "y2", "y3"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("host.example.com", ["host.example.com"]),
        ("c[5]", ["c5"]),
        ("", []),
    ],
)
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


# -- resolve_with_mpi with a stand-in communicator ------------------------------------------


class FakeComm:
    """Answers like mpi4py's COMM_WORLD would for one rank of a job: a pure function of these."""

    def __init__(self, rank, names, bcast_answer=None):
        self.rank, self.names, self.bcast_answer = rank, names, bcast_answer
        self.bcast_payloads = []

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.names)

    def allgather(self, value):
        return list(self.names)

    def bcast(self, payload, root=0):
        assert root == 0
        self.bcast_payloads.append(payload)
        return payload if self.rank == 0 else self.bcast_answer


def test_mpi4py_only_local_rank_from_processor_names():
    names = ["hostA", "hostA", "hostB", "hostB", "hostB"]
    comm = FakeComm(3, names, bcast_answer=("10.0.0.1", 4321))
    info = resolve_with_mpi(None, comm)
    assert info == RankInfo(
        rank=3,
        world_size=5,
        local_rank=1,
        local_world_size=3,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=4321,
        launcher="mpi4py",
    )
    assert comm.bcast_payloads == [None]  # only rank 0 proposes the rendezvous


def test_mpi4py_only_interleaved_hosts():
    names = ["b", "a", "b", "a"]
    info = resolve_with_mpi(None, FakeComm(2, names, bcast_answer=("m", 1)))
    assert (info.local_rank, info.local_world_size, info.node_rank) == (1, 2, 0)
    info = resolve_with_mpi(None, FakeComm(3, names, bcast_answer=("m", 1)))
    assert (info.local_rank, info.local_world_size, info.node_rank) == (1, 2, 1)


def test_rank0_single_node_broadcasts_loopback_and_picked_port():
    comm = FakeComm(0, ["h", "h"])
    info = resolve_with_mpi(None, comm, port_picker=lambda: 4242)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 4242)
    assert comm.bcast_payloads == [("127.0.0.1", 4242)]


def test_rank0_multi_node_broadcasts_a_reachable_address():
    comm = FakeComm(0, ["h1", "h2"])
    info = resolve_with_mpi(None, comm, port_picker=lambda: 5000)
    assert info.master_port == 5000
    assert info.master_addr and info.master_addr == comm.bcast_payloads[0][0]


def test_openmpi_info_gets_rendezvous_from_rank0():
    info = discover(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    out = resolve_with_mpi(info, FakeComm(1, ["h", "h"], bcast_answer=("127.0.0.1", 7777)))
    assert out == RankInfo(1, 2, 1, 2, 0, "127.0.0.1", 7777, "openmpi")


def test_rank0_keeps_given_master_addr_and_picks_port():
    info = RankInfo(0, 2, 0, 1, 0, "10.2.2.2", None, "openmpi")
    comm = FakeComm(0, ["h1", "h2"])
    out = resolve_with_mpi(info, comm, port_picker=lambda: 6000)
    assert (out.master_addr, out.master_port) == ("10.2.2.2", 6000)


class NoCallComm:
    def __getattr__(self, name):
        raise AssertionError(f"comm.{name} must not be called")


def test_complete_info_does_not_talk_to_mpi():
    info = RankInfo(1, 2, 1, 2, 0, "127.0.0.1", 1234, "openmpi")
    assert resolve_with_mpi(info, NoCallComm()) is info


@pytest.mark.parametrize(
    "env,missing",
    [
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": ""}, "WORLD_SIZE"),
        ({"PMI_RANK": "1", "PMI_SIZE": ""}, "PMI_SIZE"),
    ],
)
def test_half_set_launcher_variables_name_the_missing_one(env, missing):
    with pytest.raises(DiscoveryError, match=missing):
        discover(env)


def test_slurm_tasks_per_node_with_repeats():
    from dist_infer.topology.discovery import DiscoveryError, parse_slurm_tasks_per_node

    assert parse_slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_slurm_tasks_per_node("4") == [4]
    with pytest.raises(DiscoveryError, match="'2x3'"):
        parse_slurm_tasks_per_node("2x3")
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "7",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "3",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS_PER_NODE": "2(x3),1",
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_ID": "0",
    }  # a task of a step (srun sets the step id; the batch script has none)
    info = discover(env)
    assert info.local_world_size == 1 and info.world_size == 7

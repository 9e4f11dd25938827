"""A job of one: every Communicator op on a world of size 1, argument errors, handle timeouts.
(`comm-test` as a process of its own: tests/integration/test_comm_test_cli.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_infer.comm import CommError, CommTimeoutError, P2POp, build_groups, init_world
from dist_infer.comm.base import PollingHandle
from dist_infer.comm.init import BackendError, torch_backend_string
from dist_infer.comm.shm import ShmAllReduceCommunicator, shm_supported
from dist_infer.topology import Layout, Mesh, RankInfo, free_port


@pytest.fixture(scope="module")
def world():
    if dist.is_initialized():
        pytest.skip("a torch.distributed process group is already initialised in this process")
    info = RankInfo(0, 1, 0, 1, 0, "127.0.0.1", free_port(), "single")
    comm = init_world("gloo", timeout=30, info=info)
    yield comm
    comm.destroy()
    assert not dist.is_initialized()


def test_world_of_one(world):
    assert (world.rank, world.size, world.ranks, world.global_rank) == (0, 1, (0,), 0)
    assert world.backend == "gloo"
    assert "world" in repr(world)


@pytest.mark.parametrize("async_op", [False, True])
def test_every_op(world, async_op):
    def done(h):
        if async_op:
            assert h is not None
            h.wait(5)
            assert h.is_completed()
        else:
            assert h is None

    x = torch.arange(8, dtype=torch.float32)
    for op in ("sum", "max", "min", "prod"):
        t = x.clone()
        done(world.all_reduce(t, op=op, async_op=async_op))
        assert torch.equal(t, x)

    out = torch.empty(8)
    done(world.all_gather(out, x, async_op=async_op))
    assert torch.equal(out, x)

    out = torch.empty(2, 4)
    done(world.reduce_scatter(out, x, async_op=async_op))
    assert torch.equal(out.view(-1), x)

    m = torch.arange(12, dtype=torch.float32).view(3, 4)
    out = torch.empty(3, 4)
    done(world.all_to_all(out, m, async_op=async_op))
    assert torch.equal(out, m)
    out.zero_()
    done(world.all_to_all(out, m, output_splits=[3], input_splits=[3], async_op=async_op))
    assert torch.equal(out, m)

    t = x.clone()
    done(world.broadcast(t, src=0, async_op=async_op))
    assert torch.equal(t, x)

    done(world.barrier(async_op=async_op))

    empty = torch.empty(0)
    done(world.all_reduce(empty, async_op=async_op))


def test_bf16_and_int_dtypes(world):
    for dtype in (torch.bfloat16, torch.float16, torch.int64):
        x = torch.arange(6).to(dtype)
        out = torch.empty(6, dtype=dtype)
        world.all_gather(out, x)
        assert torch.equal(out, x)
        t = x.clone()
        world.all_reduce(t)
        assert torch.equal(t, x)


def test_batch_p2p_with_itself(world):
    a, b = torch.arange(4.0), torch.arange(4.0) * 10
    ra, rb = torch.zeros(4), torch.zeros(2, 2)
    h = world.batch_isend_irecv(
        [
            P2POp("send", a, 0, tag=1),
            P2POp("send", b, 0, tag=2),
            P2POp("recv", rb, 0, tag=2),
            P2POp("recv", ra, 0, tag=1),
        ]
    )
    h.wait(5)
    assert h.is_completed()
    assert torch.equal(ra, a) and torch.equal(rb.view(-1), b)
    assert world.batch_isend_irecv([]).is_completed()


def test_batch_p2p_with_itself_unmatched(world):
    with pytest.raises(CommError, match="recv"):
        world.batch_isend_irecv([P2POp("recv", torch.zeros(4), 0)])
    with pytest.raises(CommError, match="send"):
        world.batch_isend_irecv([P2POp("send", torch.zeros(4), 0)])


def test_split_and_build_groups(world):
    groups = build_groups(world, Mesh.build(Layout(), 1))
    for axis, comm in groups.by_axis().items():
        assert comm is world, axis  # every axis of a world of one is the world itself
    assert groups.coords == {"tp": 0, "cp": 0, "ep": 0, "dp": 0, "pp": 0}
    with pytest.raises(ValueError, match="has 2 ranks, the world has 1"):
        build_groups(world, Mesh.build(Layout(tp=2), 2))


# -- misuse raises CommError naming the op ---------------------------------------------------


def test_all_gather_shape_error(world):
    with pytest.raises(CommError, match=r"all_gather on group 'world'.*output has 7"):
        world.all_gather(torch.empty(7), torch.empty(8))
    with pytest.raises(CommError, match="all_gather"):
        world.all_gather(torch.empty(8, dtype=torch.float64), torch.empty(8))


def test_reduce_scatter_shape_error(world):
    with pytest.raises(CommError, match=r"reduce_scatter on group 'world'.*input has 8"):
        world.reduce_scatter(torch.empty(4), torch.empty(8))


def test_all_to_all_split_errors(world):
    m = torch.empty(3, 2)
    with pytest.raises(CommError, match=r"all_to_all.*input splits \[2\]"):
        world.all_to_all(torch.empty(3, 2), m, output_splits=[3], input_splits=[2])
    with pytest.raises(CommError, match=r"all_to_all.*output splits \[1, 2\]"):
        world.all_to_all(torch.empty(3, 2), m, output_splits=[1, 2], input_splits=[3])
    with pytest.raises(CommError, match=r"all_to_all.*splits \[-1\]"):
        world.all_to_all(torch.empty(3, 2), m, output_splits=[3], input_splits=[-1])


def test_peer_errors(world):
    with pytest.raises(CommError, match=r"broadcast.*peer 1 is not a rank of this group of 1"):
        world.broadcast(torch.empty(2), src=1)
    with pytest.raises(CommError, match=r"send.*peer 3"):
        world.isend(torch.empty(2), dst=3)
    with pytest.raises(CommError, match=r"recv.*peer -1"):
        world.irecv(torch.empty(2), src=-1)
    with pytest.raises(CommError, match=r"send.*peer 2"):
        world.batch_isend_irecv([P2POp("send", torch.empty(2), 2)])


def test_reduce_op_error(world):
    with pytest.raises(CommError, match="unknown reduce op 'avg'"):
        world.all_reduce(torch.empty(2), op="avg")
    with pytest.raises(CommError, match="unknown reduce op"):
        world.reduce_scatter(torch.empty(2), torch.empty(2), op="mean")


def test_p2pop_kind():
    with pytest.raises(ValueError, match="'send' or 'recv'"):
        P2POp("bcast", torch.empty(1), 0)


def test_backend_errors():
    with pytest.raises(BackendError, match="unknown backend"):
        init_world("ucx")
    assert torch_backend_string("gloo") == "gloo"
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="needs CUDA"):
            torch_backend_string("nccl")
        assert torch_backend_string("auto") == "gloo"


# -- handles ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)  # a wait that ignored its timeout would hang here: the test then fails, no clock needed
def test_polling_handle_times_out():
    h = PollingHandle(lambda: False, "all_reduce on group 'tp' (stuck)", timeout=0.3)
    with pytest.raises(CommTimeoutError, match=r"all_reduce on group 'tp' \(stuck\) did not complete"):
        h.wait()
    assert not h.is_completed()
    forever = PollingHandle(lambda: False, "all_reduce on group 'tp' (stuck)", timeout=3600)
    with pytest.raises(CommTimeoutError):
        forever.wait(timeout=0.05)  # an explicit timeout overrides the handle's hour
    assert issubclass(CommTimeoutError, CommError)


def test_polling_handle_completes_and_calls_back_once():
    polls, calls = [], []
    h = PollingHandle(lambda: polls.append(1) or len(polls) >= 50, "x", timeout=5, on_complete=lambda: calls.append(1))
    h.wait()
    assert h.is_completed() and calls == [1]
    h.wait()
    assert calls == [1]


@pytest.mark.skipif(not shm_supported(), reason="the shared-memory path runs on x86-64 with /dev/shm only")
def test_the_shm_segment_is_unmapped_on_close(world):
    """close() drops every view of the segment first: a flag view left alive made mmap refuse
    (BufferError, swallowed), and the segment stayed mapped."""
    comm = ShmAllReduceCommunicator(world)
    t, out = torch.arange(4, dtype=torch.float32), torch.zeros(4)
    comm._post(t, out).wait(5)  # one rank: a gather of its own slot, through the segment
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    comm.close()
    assert comm._mm.closed
    with pytest.raises(CommError, match="closed"):
        comm._post(t, out)

"""Memory per rank by hand: weights and the KV cache under tp and pp, and the shared-memory
collectives' segments on a CPU node."""

from __future__ import annotations

import pytest

from dist_infer.comm.shm import DEFAULT_SLOT_BYTES, NBUF
from dist_infer.planner.layout import Layout
from dist_infer.planner.memory import memory_per_rank, shm_segment_bytes
from dist_infer.planner.predict import predict
from dist_infer.planner.workload import Workload
from tests.support.plan_profiles import SMALL, gemm_only_profile


def test_memory_per_rank_by_hand():
    work = Workload(batch=2, prompt_len=100, gen_len=28)
    hw = gemm_only_profile()
    mem = memory_per_rank(SMALL, Layout(tp=2), work, hw)
    weights = 4 * (64 * 16 * (2 * 2 + 2 * 1) + 3 * 64 * 64) + 2 * 50 * 64
    assert mem["weights"] * 2**30 == pytest.approx(weights * 4)
    assert mem["kv_cache"] * 2**30 == pytest.approx(2 * 128 * 2 * 1 * 16 * 4 * 4)  # 2 seqs x 128 tokens, 1 KV head
    # pp=2: half the layers and one of the two vocabulary matrices per rank
    mem_pp = memory_per_rank(SMALL, Layout(pp=2), work, hw)
    assert mem_pp["weights"] * 2**30 == pytest.approx((2 * (12288 + 24576) + 100 * 64) * 4)


def test_memory_counts_the_shared_memory_collectives_segments_on_a_cpu_node():
    """On a CPU node a tp (or cp) group's shared segment holds NBUF buffers of one slot per rank, and
    every rank reads every slot: the largest tensor that fits a slot is resident NBUF x group times.
    A GPU node, a group spanning nodes, a tensor too big for a slot: not counted."""
    work = Workload(batch=2, prompt_len=100, gen_len=28)
    cpu = gemm_only_profile(device="cpu", shared_node=True)
    prefill_hidden = 2 * 100 * 64 * 4  # 2 sequences x 100 tokens x hidden 64, fp32: the largest tp all-reduce
    mem = memory_per_rank(SMALL, Layout(tp=2), work, cpu)
    assert mem["comm_buffers"] * 2**30 == pytest.approx(NBUF * 2 * prefill_hidden)
    mem_cp = memory_per_rank(SMALL, Layout(cp=2), work, cpu)  # a decode's partials: 2 seqs x 4 heads x (16 + 1)
    assert mem_cp["comm_buffers"] * 2**30 == pytest.approx(NBUF * 2 * 2 * 4 * 17 * 4)
    assert memory_per_rank(SMALL, Layout(tp=2), work, cpu, ranks_per_node=1)["comm_buffers"] == 0.0
    assert "comm_buffers" not in memory_per_rank(SMALL, Layout(tp=2), work, gemm_only_profile())
    assert memory_per_rank(SMALL, Layout(), work, cpu)["comm_buffers"] == 0.0
    assert shm_segment_bytes(4, [DEFAULT_SLOT_BYTES + 1, 1000]) == NBUF * 4 * 1000  # the big one goes through gloo
    assert predict(SMALL, Layout(tp=2), work, cpu).memory_gib_per_rank == pytest.approx(sum(mem.values()))

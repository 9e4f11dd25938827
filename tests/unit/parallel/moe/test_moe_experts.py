"""A rank's experts: the fused loader reads only this rank's experts and its tp rows of each
(ranks as threads, tests/support/threads.py)."""

from __future__ import annotations

import torch

from dist_infer.parallel.moe.layer import ExpertParallelMoE
from dist_infer.parallel.moe.placement import ExpertPlacement
from tests.support.moe_reference import E, H, I, K, expert_weights
from tests.support.threads import run_ranks, thread_groups


class _Recording:
    """A weight source that records which rows of which expert were read (like a lazy checkpoint slice)."""

    def __init__(self, tensor, log):
        self.tensor, self.shape, self.log = tensor, tuple(tensor.shape), log

    def __getitem__(self, index):
        self.log.append(index)
        return self.tensor[index]


def test_fused_loader_reads_only_this_ranks_experts_and_rows():
    w = expert_weights(4)
    log: list = []
    gate_up = _Recording(torch.cat([w["w1"], w["w3"]], dim=1), log)
    down = _Recording(w["w2"], log)

    def body(g):
        layer = ExpertParallelMoE(H, I, E, K, True, ExpertPlacement.contiguous(E, 4), g.tp, g.ep)
        if g.ep.rank == 1 and g.tp.rank == 1:
            layer.experts.load_fused(gate_up, down, E)
        return None

    run_ranks(thread_groups(2, 4), body)
    experts = {ix[0].start for ix in log}
    assert experts == {2, 3}, f"rank ep1/tp1 owns experts 2 and 3, read {sorted(experts)}"
    assert all(ix[0].stop - ix[0].start == 1 for ix in log)
    rows = {(ix[1].start, ix[1].stop) for ix in log if len(ix) == 3 and ix[1] != slice(None)}
    assert rows == {(12, 24), (36, 48)}, rows  # the second half of gate rows and of up rows (I=24, tp=2)

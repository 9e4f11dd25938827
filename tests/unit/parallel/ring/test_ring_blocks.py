"""The block plan of one ring step: square causal blocks, no block for keys no query can see."""

from __future__ import annotations

from dist_infer.parallel.ring.blocks import plan_blocks
from dist_infer.parallel.ring.shards import runs_from_positions


def test_plan_blocks_are_square_when_causal_and_skip_invisible_keys():
    q_runs = runs_from_positions([10, 11, 12, 13, 14, 15])
    k_runs = runs_from_positions([4, 5, 6, 12, 13, 14, 15, 16, 17], row=0)  # two runs: 4..6 and 12..17
    blocks = plan_blocks(q_runs, k_runs, causal=True)
    for b in blocks:
        if b.causal:
            assert b.q1 - b.q0 == b.k1 - b.k0
    seen = {
        (qi, ki)
        for b in blocks
        for qi in range(b.q0, b.q1)
        for ki in range(b.k0, b.k1)
        if not b.causal or ki - b.k0 <= qi - b.q0
    }
    want = {
        (qi, ki)
        for qi, qp in enumerate([10, 11, 12, 13, 14, 15])
        for ki, kp in enumerate([4, 5, 6, 12, 13, 14, 15, 16, 17])
        if kp <= qp
    }
    assert seen == want
    assert plan_blocks(runs_from_positions([0, 1]), runs_from_positions([5, 6]), causal=True) == []

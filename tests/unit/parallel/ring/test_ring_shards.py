"""The zigzag index maps: every position on exactly one rank, equal causal work per rank and per
ring step, a bad rank refused by name."""

from __future__ import annotations

import pytest

from dist_infer.parallel.ring.blocks import ring_step_flops
from dist_infer.parallel.ring.errors import RingAttentionError
from dist_infer.parallel.ring.layout import RingLayout
from dist_infer.parallel.ring.shards import runs_from_positions, zigzag_chunks


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_zigzag_covers_every_position_once(cp):
    for seq_len in range(0, 43):
        shards = [zigzag_chunks(seq_len, cp, r) for r in range(cp)]
        held = sorted(p for s in shards for p in s.positions)
        assert held == list(range(seq_len)), f"seq_len {seq_len}, cp {cp}"
        chunk = shards[0].chunk
        assert 2 * cp * chunk >= seq_len > 2 * cp * (chunk - 1) or seq_len == 0
        for r, s in enumerate(shards):
            assert s.chunks == (r, 2 * cp - 1 - r)
            want = [p for c in s.chunks for p in range(c * chunk, (c + 1) * chunk) if p < seq_len]
            assert list(s.positions) == want
            assert s.num_rows + s.padding == 2 * chunk
        assert sum(s.padding for s in shards) == 2 * cp * chunk - seq_len
        for s in shards:
            assert s.runs(3, 5) == runs_from_positions(s.positions, 3, 5)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(cp):
    seq_len = 2 * cp * 16
    work = [sum(p + 1 for p in zigzag_chunks(seq_len, cp, r).positions) for r in range(cp)]
    assert len(set(work)) == 1, f"causal query-key pairs per rank {work} should be equal"
    steps = [
        [ring_step_flops(blocks, 1, 1) for blocks in RingLayout.zigzag([seq_len], cp).steps(r, "pass-kv")]
        for r in range(cp)
    ]
    for i in range(1, cp):  # every off-diagonal ring step is half a block on every rank
        assert len({s[i] for s in steps}) == 1, f"step {i}: work per rank {[s[i] for s in steps]}"


def test_zigzag_rejects_bad_ranks():
    with pytest.raises(RingAttentionError, match="rank 2 is not a rank of a cp group of 2"):
        zigzag_chunks(10, 2, 2)

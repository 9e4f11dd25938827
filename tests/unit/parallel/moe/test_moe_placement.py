"""Expert placement, no processes: the imbalance measure, contiguous placement, errors that name
the numbers, and balanced_placement (evens out a skew, swaps past greedy, deterministic)."""

from __future__ import annotations

import pytest
import torch

from dist_infer.parallel.moe.placement import ExpertPlacement, balanced_placement, imbalance
from dist_infer.parallel.sharding import ShardingError


def test_imbalance():
    assert imbalance([5, 5]) == 1.0
    assert imbalance([10, 0, 0, 0]) == 4.0
    assert imbalance([0, 0]) == 1.0
    assert imbalance([3, 1]) == 1.5


def test_contiguous_placement():
    p = ExpertPlacement.contiguous(8, 4)
    assert p.owner == (0, 0, 1, 1, 2, 2, 3, 3)
    assert p.local_experts(2) == [4, 5]
    assert p.rank_loads([1, 2, 3, 4, 5, 6, 7, 8]) == [3, 7, 11, 15]


@pytest.mark.parametrize(
    "owner,ep,needle",
    [
        ((0, 0, 1), 2, "3 experts cannot be split evenly over ep=2 (3 % 2 = 1)"),
        ((0, 0, 0, 1), 2, "gives the 2 ranks [3, 1] experts; each must own 2"),
        ((0, 2, 1, 1), 2, "names ranks [2] outside ep=2"),
    ],
)
def test_placement_errors_name_the_numbers(owner, ep, needle):
    with pytest.raises(ShardingError) as exc:
        ExpertPlacement(owner, ep)
    assert needle in str(exc.value)


def test_contiguous_placement_error():
    with pytest.raises(ShardingError, match=r"6 experts cannot be split evenly over ep=4 \(6 % 4 = 2\)"):
        ExpertPlacement.contiguous(6, 4)


def test_balanced_placement_evens_out_a_skew():
    counts = [100, 90, 10, 5, 4, 3, 2, 1]  # contiguous over 2: [205, 10]
    owner = balanced_placement(counts, 2)
    p = ExpertPlacement(tuple(owner), 2)  # validates: 4 experts per rank
    loads = p.rank_loads(counts)
    assert imbalance(loads) < imbalance(ExpertPlacement.contiguous(8, 2).rank_loads(counts))
    assert max(loads) == 108  # the optimum: 215 tokens, {100, 4, 3, 1} vs {90, 10, 5, 2}
    assert balanced_placement(counts, 2) == owner  # deterministic


def test_balanced_placement_swaps_past_greedy():
    # LPT alone gives {8, 5, 4} = 17 vs {7, 6, 1} = 14; a swap reaches 16 vs 15.
    counts = [8, 7, 6, 5, 4, 1]
    loads = ExpertPlacement(tuple(balanced_placement(counts, 2)), 2).rank_loads(counts)
    assert sorted(loads) == [15, 16]


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_balanced_placement_random_counts(ep):
    gen = torch.Generator().manual_seed(ep)
    counts = (torch.rand(16, generator=gen) ** 4 * 1000).round().tolist()
    p = ExpertPlacement(tuple(balanced_placement(counts, ep)), ep)
    lpt_bound = sum(counts) / ep + max(counts)
    assert max(p.rank_loads(counts)) <= lpt_bound
    assert imbalance(p.rank_loads(counts)) <= imbalance(ExpertPlacement.contiguous(16, ep).rank_loads(counts)) + 1e-9


def test_balanced_placement_rejects_uneven_split():
    with pytest.raises(ShardingError, match="5 experts cannot be split evenly over ep=2"):
        balanced_placement([1, 2, 3, 4, 5], 2)

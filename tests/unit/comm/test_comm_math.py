"""Pure functions: comm-test's expected values and bandwidth factors (the launcher's plans:
tests/unit/launch/test_launch_plans.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dist_infer.comm.selftest import _Case, a2a_rows, a2a_width, bus_bandwidth_factor, expected, pattern

# -- bus bandwidth factors (nccl-tests convention) ------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_bus_bandwidth_factor(n):
    assert bus_bandwidth_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_bandwidth_factor(op, n) == pytest.approx((n - 1) / n)
    for op in ("broadcast", "send_recv", "batch_p2p"):
        assert bus_bandwidth_factor(op, n) == 1.0
    assert bus_bandwidth_factor("barrier", n) == 0.0


def test_bus_bandwidth_factor_single_rank():
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"):
        assert bus_bandwidth_factor(op, 1) == 1.0
    assert bus_bandwidth_factor("barrier", 1) == 0.0
    assert bus_bandwidth_factor("all_reduce", 4) == 1.5
    assert bus_bandwidth_factor("all_reduce", 2) == 1.0


# -- expected(...) against a brute-force simulation ----------------------------------------

GLOBAL = [5, 2, 7, 0]  # global ranks of the simulated group (deliberately not 0..n-1)
SIM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv", "batch_p2p")


def _cases(op, n, numel):
    ranks = GLOBAL[:n]
    return [_Case(op, SimpleNamespace(size=n, rank=me, ranks=tuple(ranks)), numel) for me in range(n)]


def simulate(op, cases):
    """Move the data of every rank's buffers as `op` defines it, by brute force."""
    n = len(cases)
    srcs = [c.src.clone() for c in cases]
    for me, case in enumerate(cases):
        out = case.out
        if op == "all_reduce":
            total = torch.zeros_like(srcs[0])
            for s in srcs:
                total += s
            out.copy_(total)
        elif op == "all_gather":
            out.copy_(torch.cat([s.reshape(-1) for s in srcs]).reshape(out.shape))
        elif op == "reduce_scatter":
            chunk = out.numel()
            total = torch.zeros_like(srcs[0])
            for s in srcs:
                total += s
            out.copy_(total[me * chunk : (me + 1) * chunk].reshape(out.shape))
        elif op == "all_to_all":
            pieces = []
            for src in range(n):
                start = sum(cases[src].in_splits[:me])
                pieces.append(srcs[src][start : start + cases[src].in_splits[me]])
            assert [p.shape[0] for p in pieces] == case.out_splits
            out.copy_(torch.cat(pieces))
        elif op == "broadcast":
            out.copy_(srcs[0])
        elif op in ("send_recv", "batch_p2p"):
            out.copy_(srcs[(me - 1) % n])
        else:
            raise ValueError(op)


@pytest.mark.parametrize("op", SIM_OPS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [4, 7, 1024, 1031])
def test_expected_matches_simulation(op, n, numel):
    numel = max(n, numel)  # what run_comm_test asks for
    cases = _cases(op, n, numel)
    simulate(op, cases)
    for me, case in enumerate(cases):
        want = expected(op, case.comm.ranks, me, numel).reshape(case.out.shape)
        assert torch.equal(case.out, want), f"{op} n={n} rank {me}"
        assert case.check()


@pytest.mark.parametrize("op", SIM_OPS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_check_catches_wrong_data(op, n):
    cases = _cases(op, n, 64)
    simulate(op, cases)
    victim = cases[-1]
    if victim.out.numel() == 0:
        pytest.skip("this rank receives nothing")
    victim.out.view(-1)[0] += 1
    assert not victim.check()


def test_all_to_all_splits_unequal_with_zero_rows():
    for n in (2, 3, 4):
        rows = [[a2a_rows(i, j) for j in range(n)] for i in range(n)]
        assert any(r == 0 for row in rows for r in row)
        assert len({r for row in rows for r in row}) > 1
        cases = _cases("all_to_all", n, 1024)
        for me, case in enumerate(cases):
            assert case.in_splits == rows[me]
            assert case.out_splits == [rows[i][me] for i in range(n)]
            assert case.src.shape == (sum(rows[me]), a2a_width(1024, n))


def test_pattern_exact_and_rank_dependent():
    a, b = pattern(0, 1000), pattern(1, 1000)
    assert a.dtype == torch.float32 and not torch.equal(a, b)
    assert torch.equal(a, pattern(0, 1000))
    total = sum(pattern(r, 1000) for r in range(1024))
    assert torch.equal(total, total.round())  # integers, exact in fp32


def test_expected_unknown_op():
    with pytest.raises(ValueError):
        expected("gather", [0, 1], 0, 8)

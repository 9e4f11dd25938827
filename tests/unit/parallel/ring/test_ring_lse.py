"""The log-sum-exp merge of partial attentions: exact over the union, in place into views of the
accumulators, empty sets as the identity (never NaN), stable with huge log-sum-exps, many at once
in any order."""

from __future__ import annotations

import pytest
import torch

from dist_infer.parallel.ring.lse import merge_into, merge_many, merge_partials


def _partial(scores, values):
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ values, lse


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merge_partials_equals_attention_over_the_union(dtype):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 3, 20, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(20, 8, generator=gen, dtype=torch.float64)
    want, want_lse = _partial(scores, values)
    o1, l1 = _partial(scores[..., :7], values[:7])
    o2, l2 = _partial(scores[..., 7:], values[7:])
    o, lse = merge_partials(o1.to(dtype), l1.to(dtype), o2.to(dtype), l2.to(dtype))
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert o.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(o.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def test_merge_into_writes_the_merge_into_views_of_the_accumulators():
    gen = torch.Generator().manual_seed(5)
    acc_o, acc_lse = torch.zeros(6, 3, 4), torch.full((6, 3), float("-inf"))
    o1, l1 = torch.randn(4, 3, 4, generator=gen), torch.randn(4, 3, generator=gen)
    o2, l2 = torch.randn(4, 3, 4, generator=gen), torch.randn(4, 3, generator=gen)
    merge_into(acc_o[1:5], acc_lse[1:5], o1, l1)  # into empty rows: the identity
    assert torch.equal(acc_o[1:5], o1) and torch.equal(acc_lse[1:5], l1)
    merge_into(acc_o[1:5], acc_lse[1:5], o2, l2)
    want_o, want_lse = merge_partials(o1, l1, o2, l2)
    torch.testing.assert_close(acc_o[1:5], want_o, atol=0, rtol=0)
    torch.testing.assert_close(acc_lse[1:5], want_lse, atol=0, rtol=0)
    assert not acc_o[0].any() and not acc_o[5].any() and torch.isneginf(acc_lse[[0, 5]]).all(), "other rows untouched"


def test_merge_partials_empty_sets_are_the_identity():
    o = torch.randn(4, 6)
    lse = torch.randn(4)
    empty_o, empty_lse = torch.zeros(4, 6), torch.full((4,), float("-inf"))
    for a, b in (((o, lse), (empty_o, empty_lse)), ((empty_o, empty_lse), (o, lse))):
        mo, ml = merge_partials(*a, *b)
        assert torch.equal(mo, o) and torch.equal(ml, lse)
    mo, ml = merge_partials(empty_o, empty_lse, empty_o, empty_lse)
    assert torch.equal(mo, empty_o) and torch.isneginf(ml).all(), "two empty sets must stay empty, never NaN"


def test_merge_partials_stable_with_large_log_sum_exps():
    # fp32 with LSEs of magnitude 1e4 (huge logits): the naive exp overflows, the stable form does not.
    o1, o2 = torch.randn(3, 4), torch.randn(3, 4)
    l1 = torch.tensor([10000.0, -10000.0, 50.0])
    l2 = torch.tensor([10001.0, -9999.5, -20000.0])
    o, lse = merge_partials(o1, l1, o2, l2)
    w1 = torch.exp(l1.double() - torch.logaddexp(l1.double(), l2.double()))
    want = w1[:, None] * o1.double() + (1 - w1[:, None]) * o2.double()
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), torch.logaddexp(l1.double(), l2.double()), atol=1e-3, rtol=1e-7)


def test_merge_many_equals_pairwise_merges_in_any_order():
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(4, 6, 2, 5, generator=gen, dtype=torch.float64)
    lse = torch.randn(4, 6, 2, generator=gen, dtype=torch.float64) * 3
    lse[2, 1] = float("-inf")  # one partial empty for some rows
    lse[:, 4, 0] = float("-inf")  # every partial empty for one row
    o[:, 4, 0] = 0
    mo, ml = merge_many(o, lse)
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        po, pl = o[order[0]], lse[order[0]]
        for i in order[1:]:
            po, pl = merge_partials(po, pl, o[i], lse[i])
        torch.testing.assert_close(mo, po, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(ml, pl, atol=1e-12, rtol=1e-12)
    assert torch.isneginf(ml[4, 0]) and not torch.isnan(mo).any()

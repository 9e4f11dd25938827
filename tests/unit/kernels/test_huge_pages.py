"""Weights and the KV cache on huge pages (kernels/huge_pages.py): every contiguous CPU parameter and
buffer moved into one mapping that asks for them, each tensor keeping its identity (tied weights stay
tied) and its values; a module too small for a huge page left alone."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from dist_infer.kernels.huge_pages import HUGE_PAGE_BYTES, weights_on_huge_pages, zeroed_pool
from tests.support.smaps import thp_eligible, thp_on

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc smaps (not Linux)")


class Tied(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter in two modules
        self.norm = nn.LayerNorm(hidden)
        self.register_buffer("packed", torch.randint(0, 255, (vocab, hidden // 2), dtype=torch.uint8))
        self.register_buffer("strided", torch.randn(hidden, 8).t())  # not contiguous: left where it is


def test_weights_move_into_one_mapping_keeping_their_identity_and_values():
    torch.manual_seed(0)
    m = Tied(4096, 256)
    before = {name: t.clone() for name, t in list(m.named_parameters()) + list(m.named_buffers())}
    objects = {name: t for name, t in list(m.named_parameters()) + list(m.named_buffers())}
    strided_at = m.strided.data_ptr()
    moved = weights_on_huge_pages(m)
    assert moved >= sum(t.numel() * t.element_size() for name, t in objects.items() if name != "strided")
    after = dict(list(m.named_parameters()) + list(m.named_buffers()))
    assert all(after[name] is objects[name] for name in objects), "the same tensors, their memory swapped"
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert m.head.weight is m.embed.weight, "still tied"
    assert m.strided.data_ptr() == strided_at
    base = m.embed.weight.untyped_storage().data_ptr()
    for name in ("embed.weight", "norm.weight", "norm.bias", "packed"):
        t = after[name]
        assert t.untyped_storage().data_ptr() == base and t.data_ptr() % 64 == 0, name
    if thp_on() is not None:
        assert thp_eligible(base) is thp_on()
    x = torch.randint(0, 4096, (3,))
    assert torch.equal(m.head(m.embed(x)), before["embed.weight"][x] @ before["embed.weight"].t())


def test_a_module_under_a_huge_page_stays_where_it_is():
    m = nn.Linear(16, 16)
    at = m.weight.data_ptr()
    assert weights_on_huge_pages(m) == 0 and m.weight.data_ptr() == at
    assert 16 * 16 * 4 < HUGE_PAGE_BYTES


def test_a_zeroed_pool_is_zeros_of_its_dtype_on_a_mapping_of_its_own():
    pool = zeroed_pool(HUGE_PAGE_BYTES, torch.bfloat16)
    assert pool.dtype == torch.bfloat16 and pool.numel() == HUGE_PAGE_BYTES and not pool.any()
    if thp_on() is not None:
        assert thp_eligible(pool.data_ptr()) is thp_on()
    assert not zeroed_pool(10, torch.float32).any()

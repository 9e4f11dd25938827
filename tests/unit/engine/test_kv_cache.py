"""The paged KV cache's block accounting: reserve and advance per sequence, no block shared, a
full cache refused by name, every block back exactly once after free."""

from __future__ import annotations

import os

import pytest
import torch

from dist_infer.engine.block_pool import BlockPool, CacheFullError
from dist_infer.engine.kv_cache import PagedKVCache, blocks_for, stacked_layers
from tests.support.smaps import thp_eligible, thp_on


def test_paged_kv_cache_block_accounting():
    cache = PagedKVCache(num_layers=2, num_blocks=6, block_size=4, kv_heads=2, head_dim=8)
    assert len(cache.layers) == 2 and cache.layers[0][0].shape == (6, 4, 2, 8)
    assert cache.bytes == 2 * 2 * 6 * 4 * 2 * 8 * 4
    a = cache.reserve(0, 5)
    assert len(a) == 2 and cache.allocator.num_free == 4
    cache.advance(0, 5)
    assert cache.reserve(0, 3) == a, "8 tokens still fit in 2 blocks"
    cache.advance(0, 3)
    assert len(cache.reserve(0, 1)) == 3
    cache.advance(0, 1)
    b = cache.reserve(1, 12)
    assert len(b) == 3 and cache.allocator.num_free == 0
    assert not set(a) & set(b), "sequences never share a block"
    assert cache.lengths == {0: 9, 1: 0}
    with pytest.raises(CacheFullError, match="6 blocks"):
        cache.reserve(2, 1)
    cache.free(0)
    assert cache.allocator.num_free == 3 and 0 not in cache.tables and 0 not in cache.lengths
    cache.free(1)
    cache.free(2)  # a sequence that got nothing (its reserve failed): freeing is harmless
    assert cache.allocator.num_free == 6
    assert sorted(cache.allocator._free) == list(range(6)), "every block came back exactly once"
    cache.free(7)  # unknown sequence: no-op
    assert cache.allocator.num_free == 6


def test_block_allocator_and_blocks_for():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    alloc = BlockPool(3)
    got = [alloc.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    with pytest.raises(CacheFullError):
        alloc.allocate()
    alloc.free(got)
    assert alloc.num_free == 3


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc smaps (not Linux)")
def test_the_cpu_kv_cache_is_one_zeroed_mapping_asked_for_huge_pages():
    """Every layer's K and V are zeros, views of one anonymous mapping that the kernel may back with
    2 MB pages (madvise; a dead instance's memory is then unmapped in ms); a small cache stays in
    torch's allocator."""
    cache = PagedKVCache(num_layers=3, num_blocks=200, block_size=16, kv_heads=2, head_dim=64)
    tensors = [t for kv in cache.layers for t in kv]
    assert all(t.is_contiguous() and not t.any() for t in tensors)
    base = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in tensors), "one mapping for all"
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in tensors)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "no two views overlap"
    tensors[-1][3, 5] = 1.0
    assert tensors[-1].sum() == 2 * 64 and tensors[0].sum() == 0
    if thp_on() is not None:  # (a kernel without THP: nothing to ask for)
        assert thp_eligible(base) is thp_on()
    small = PagedKVCache(num_layers=1, num_blocks=2, block_size=4, kv_heads=1, head_dim=8)
    assert not small.layers[0][0].any()


def test_stacked_layers_is_the_pool_the_layers_are_views_of():
    cache = PagedKVCache(num_layers=3, num_blocks=5, block_size=4, kv_heads=2, head_dim=8)
    for layer, (k, v) in enumerate(cache.layers):
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    stacked = stacked_layers(cache.layers)
    assert stacked is not None and stacked.shape == (3, 2, 5, 4, 2, 8)
    for layer, (k, v) in enumerate(cache.layers):
        assert torch.equal(stacked[layer, 0], k) and torch.equal(stacked[layer, 1], v)
    stacked[1, 1, 2] = 7.0  # a view: writes land in the layers' own tensors
    assert bool((cache.layers[1][1][2] == 7.0).all())
    separate = [(torch.zeros(5, 4, 2, 8), torch.zeros(5, 4, 2, 8)) for _ in range(3)]
    assert stacked_layers(separate) is None, "tensors of their own: no one view covers them"
    assert stacked_layers([]) is None
    uneven = [cache.layers[0], cache.layers[2]]  # views of one pool, but not evenly spaced from the first
    assert (
        stacked_layers(uneven) is not None
        and stacked_layers([cache.layers[0], cache.layers[2], cache.layers[1]]) is None
    )

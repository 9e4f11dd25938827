"""The paged KV cache's block accounting: reserve and advance per sequence, no block shared, a
full cache refused by name, every block back exactly once after free."""

from __future__ import annotations

import pytest

from dist_infer.engine.kv_cache import BlockAllocator, CacheFullError, PagedKVCache, blocks_for


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
    alloc = BlockAllocator(3)
    got = [alloc.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    with pytest.raises(CacheFullError):
        alloc.allocate()
    alloc.free(got)
    assert alloc.num_free == 3

"""Leases in the block pool (engine/block_pool.py): a block only leases hold is allocatable, taken
back oldest first and only when nothing is free or evictable (its holder told first), and a lease
never breaks free + used + evictable == total."""

from __future__ import annotations

import pytest

from dist_infer.engine.block_pool import BlockPool, CacheFullError


def cached_pool(n: int, cached: int) -> tuple[BlockPool, list[int]]:
    pool = BlockPool(n)
    blocks = [pool.allocate() for _ in range(cached)]
    for i, b in enumerate(blocks):
        assert pool.register(b, 1000 + i)
    pool.free(blocks)
    return pool, blocks


def test_a_block_only_leases_hold_is_allocatable_and_taken_last_oldest_first():
    pool, blocks = cached_pool(4, 2)
    told: list[int] = []

    def reclaim(block):
        told.append(block)
        pool.unlease(block)

    pool.on_reclaim = reclaim
    for b in blocks:
        pool.lease(b)
    assert pool.num_free == 4 and pool.num_unleased_free == 2 and pool.num_leased == 2
    got = [pool.allocate(), pool.allocate()]
    assert set(got).isdisjoint(blocks) and told == [], "free blocks go before leased ones"
    assert pool.allocate() == blocks[0] and told == [blocks[0]], "then the oldest lease-only block"
    assert pool.lookup(1000) is None, "a reclaimed block is forgotten"
    assert pool.check() is None


def test_a_leased_block_a_request_takes_is_not_reclaimable_until_it_lets_go():
    pool, blocks = cached_pool(2, 1)
    pool.lease(blocks[0])
    pool.take([blocks[0]])  # a failover's prefix hit
    assert pool.num_free == 1 and pool.reclaimed_by([blocks[0]]) == 0
    pool.allocate()
    with pytest.raises(CacheFullError):
        pool.allocate()
    pool.free([blocks[0]])
    assert pool.num_free == 1 and pool.check() is None
    pool.unlease(blocks[0])
    assert pool.num_evictable == 1 and pool.num_leased == 0 and pool.check() is None


def test_two_leases_on_one_block_and_the_errors():
    pool, blocks = cached_pool(2, 1)
    b = blocks[0]
    pool.lease(b)
    pool.lease(b)
    assert pool.refcount(b) == 2 and pool.reclaimed_by([b]) == 1
    pool.unlease(b)
    assert pool.num_leased == 1 and pool.check() is None
    pool.unlease(b)
    with pytest.raises(ValueError, match="not leased"):
        pool.unlease(b)
    fresh = pool.allocate()
    with pytest.raises(ValueError, match="not cached"):
        pool.lease(fresh if fresh != b else pool.allocate())

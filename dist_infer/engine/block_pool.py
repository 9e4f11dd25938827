"""The one pool of KV block ids: a free list with reference counts, and the full blocks kept by
their hash for prefix caching (engine/prefix_cache.py names them). The scheduler allocates from it,
and so does a paged cache that keeps its own tables (context parallel). A block nobody holds keeps
its contents and hash (evictable) until a new block is needed and none is free; so free + used +
evictable == total, always.

A lease (KV mirroring, engine/mirror/) holds a cached block for another instance's request: a
reference like any other, except that a block only leases hold is still allocatable. When a new
block is needed and nothing is free or evictable, the oldest such block is reclaimed
(`on_reclaim` tells the lease holder first): mirrors go before any request is preempted."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Optional, Sequence

EVENTS_PER_BLOCK = 4  # KV events kept untaken, per block of the pool


class CacheFullError(RuntimeError):
    """No free block left for a sequence's next tokens."""


class BlockPool:
    """The scheduler's KV blocks: a free list, reference counts, and the cached blocks by hash.
    With nothing registered it is a plain free list: the paged cache's own, under context parallel."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # never cached (or forgotten): popped from the end
        self._refs = [0] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._evictable: "OrderedDict[int, None]" = OrderedDict()  # cached, held by nobody: least recent first
        # hashes registered and evicted since the last take_events (KV events); bounded, since an
        # offline engine never takes them (a server takes them every step)
        self._stored: deque[int] = deque(maxlen=EVENTS_PER_BLOCK * num_blocks)
        self._removed: deque[int] = deque(maxlen=EVENTS_PER_BLOCK * num_blocks)
        self._lease_refs: dict[int, int] = {}  # block -> how many of its references are leases
        self._lease_only: "OrderedDict[int, None]" = OrderedDict()  # held by leases alone: oldest first
        self.on_reclaim: Callable[[int], None] = lambda block: None  # must drop every lease on the block

    # -- the allocator interface (scheduler, migration) ----------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocatable now: the free ones, the cached ones nobody holds, and those only leases hold."""
        return len(self._free) + len(self._evictable) + len(self._lease_only)

    @property
    def num_unleased_free(self) -> int:
        """Blocks allocatable without reclaiming a lease (what a new lease may take)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash (held or not)."""
        return len(self._by_hash)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        """A private block: a free one, else the least recently freed cached one (forgotten), else
        the oldest block only leases hold (its holder told first)."""
        if not self._free and not self._evictable and self._lease_only:
            block = next(iter(self._lease_only))
            self.on_reclaim(block)
            if self._lease_refs.get(block):
                raise RuntimeError(f"block {block} reclaimed but still leased")
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            evicted = self._hash_of.pop(block)
            del self._by_hash[evicted]
            self._removed.append(evicted)
        else:
            raise CacheFullError(f"KV cache full: all {self.num_blocks} blocks in use")
        self._refs[block] = 1
        return block

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. The tail goes first, so of a sequence's cached
        blocks its last ones are evicted first (its prefix, more likely shared, stays longest)."""
        for block in reversed(blocks):
            if self._refs[block] <= 0:
                raise ValueError(f"block {block} freed but not held")
            self._refs[block] -= 1
            self._mark_lease_only(block)
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # -- the cache -------------------------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest run of `hashes`, from the first, that are cached (not taken)."""
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def reclaimed_by(self, blocks: Sequence[int]) -> int:
        """How many allocatable blocks taking `blocks` (a match) uses up: those nobody (or only a lease) holds."""
        return sum(1 for b in blocks if self._refs[b] == 0 or b in self._lease_only)

    def take(self, blocks: Sequence[int]) -> None:
        """Hold matched blocks (one more reference each; an evictable one is no longer evictable)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            self._lease_only.pop(block, None)

    def register(self, block: int, block_hash: int) -> bool:
        """Cache a held full block under its hash; False (and nothing changes) if another block has
        that hash already or this one is cached (the sequence keeps its own copy, private)."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} registered but not held")
        if block_hash in self._by_hash or block in self._hash_of:
            return False
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        self._stored.append(block_hash)
        return True

    def lookup(self, block_hash: int) -> Optional[int]:
        """The cached block under this hash, or None."""
        return self._by_hash.get(block_hash)

    def lease(self, block: int) -> None:
        """Hold a cached block for a lease (released by `unlease`)."""
        if block not in self._hash_of:
            raise ValueError(f"block {block} leased but not cached")
        self.take([block])
        self._lease_refs[block] = self._lease_refs.get(block, 0) + 1
        self._mark_lease_only(block)

    def unlease(self, block: int) -> None:
        """Let go of one lease on the block (the last reference: it is evictable again)."""
        n = self._lease_refs.get(block, 0)
        if n <= 0:
            raise ValueError(f"block {block} unleased but not leased")
        if n == 1:
            del self._lease_refs[block]
        else:
            self._lease_refs[block] = n - 1
        self._lease_only.pop(block, None)
        self.free([block])

    def _mark_lease_only(self, block: int) -> None:
        if self._refs[block] > 0 and self._refs[block] == self._lease_refs.get(block, 0):
            self._lease_only[block] = None
        else:
            self._lease_only.pop(block, None)

    @property
    def num_leased(self) -> int:
        """Blocks a lease holds (some may be held by requests too)."""
        return len(self._lease_refs)

    def take_events(self) -> tuple[list[int], list[int]]:
        """The hashes cached and evicted since the last call, in order (what the instance reports
        so the front end's prefix index, and so dispatch, see this cache)."""
        events = (list(self._stored), list(self._removed))
        self._stored.clear()
        self._removed.clear()
        return events

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def check(self) -> Optional[str]:
        """What breaks the pool's invariants (free + used + evictable == total, ...), or None."""
        used = sum(1 for r in self._refs if r > 0)
        if len(self._free) + used + len(self._evictable) != self.num_blocks:
            return f"free {len(self._free)} + used {used} + evictable {len(self._evictable)} != {self.num_blocks}"
        if any(self._refs[b] != 0 for b in self._free) or any(self._refs[b] != 0 for b in self._evictable):
            return "a free or evictable block is held"
        if any(b in self._hash_of for b in self._free):
            return "a block on the free list is still cached"
        if any(b not in self._hash_of for b in self._evictable):
            return "an evictable block is not cached"
        if any(self._hash_of.get(b) != h for h, b in self._by_hash.items()) or len(self._hash_of) != len(self._by_hash):
            return "the hash maps disagree"
        if any(n > self._refs[b] or b not in self._hash_of for b, n in self._lease_refs.items()):
            return "a lease holds a block more often than it is held, or an uncached one"
        if set(self._lease_only) != {b for b, n in self._lease_refs.items() if n == self._refs[b]}:
            return "the blocks only leases hold are miscounted"
        return None

"""The one pool of KV block ids: a free list with reference counts, and the full blocks kept by
their hash for prefix caching (engine/prefix_cache.py names them). The scheduler allocates from it,
and so does a paged cache that keeps its own tables (context parallel). A block nobody holds keeps
its contents and hash (evictable) until a new block is needed and none is free; so free + used +
evictable == total, always."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Optional, Sequence

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

    # -- the allocator interface (scheduler, migration) ----------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocatable now: the free ones and the cached ones nobody holds."""
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
        """A private block: a free one, else the least recently freed cached one (forgotten)."""
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
        """How many allocatable blocks taking `blocks` (a match) uses up: those nobody holds."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        """Hold matched blocks (one more reference each; an evictable one is no longer evictable)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

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
        return None

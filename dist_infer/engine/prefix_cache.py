"""Automatic prefix caching (vLLM's): a block pool whose full blocks are found again by content.

A full KV block is named by a hash of its parent block's hash and its token ids: the hash of
block i covers every token before it, so two sequences share block i exactly when their first
(i + 1) * block_size tokens are the same (its keys and values depend on nothing else: positions
follow from the chain). A new request takes the longest run of cached blocks its tokens match
and computes only the rest.

Blocks are reference counted. A block nobody holds any more keeps its contents and its hash
(cached, evictable) until a new block is needed and none is free: then the least recently
freed one is taken and forgotten. So free + used + cached-evictable == total, always, and
`num_free` (allocatable now) counts the evictable ones.

The hash is blake2b, not Python's `hash()` (salted per process): instances compare hashes. It is
128 bits (HASH_BYTES): a block is served to whoever presents its hash, so finding two prompts whose
blocks collide must cost ~2**64 work, not the ~2**32 of a 64-bit hash.

A request's cache salt (vLLM's `cache_salt`; the front end's per-API-key salt, serving/http/cache_isolation.py)
is mixed into its first block's hash, and every later block chains from that one: requests share
cached blocks only when their salts are equal (no salt is a salt of its own).
Only the scheduler registers blocks, and only full blocks whose keys and values a launched step
of this engine wrote; nobody ever writes into a registered block again.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from typing import Optional, Sequence

from dist_infer.engine.kv_cache import CacheFullError

EVENTS_PER_BLOCK = 4  # KV events kept untaken, per block of the pool
HASH_BYTES = 16  # 128-bit block hashes (Python ints; they travel pickled, never in a fixed-width field)
ROOT_HASH = int.from_bytes(hashlib.blake2b(b"dist_infer prefix cache", digest_size=HASH_BYTES).digest(), "little")


def hash_block(parent: int, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> int:
    """A stable 128-bit name for a full block: its parent's hash, the salt (first blocks only; its
    length goes first, so no salt and no tokens read as another's) and its token ids (int32)."""
    h = hashlib.blake2b(parent.to_bytes(HASH_BYTES, "little"), digest_size=HASH_BYTES)
    if cache_salt is not None:
        salt = cache_salt.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<Q", len(salt)) + salt)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(h.digest(), "little")


def extend_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int,
                  cache_salt: Optional[str] = None) -> list[int]:
    """Grow `hashes` (a sequence's block hashes so far) to its first `num_blocks` full blocks;
    `cache_salt` goes into the first block's hash (and so, by the chain, into every block's)."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        tokens = token_ids[i * block_size:(i + 1) * block_size]
        if len(tokens) < block_size:
            raise ValueError(f"block {i} is not full ({len(tokens)} of {block_size} tokens)")
        hashes.append(hash_block(hashes[-1], tokens) if hashes else hash_block(ROOT_HASH, tokens, cache_salt))
    return hashes


class BlockPool:
    """The scheduler's KV blocks: a free list, reference counts, and the cached blocks by hash.
    With nothing registered it is the plain free list (the same block order as BlockAllocator)."""

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

"""Automatic prefix caching (vLLM's): the names by which full blocks are found again by content
(the pool that keeps them: engine/block_pool.py).

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
from typing import Optional, Sequence

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


def extend_hashes(
    hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int, cache_salt: Optional[str] = None
) -> list[int]:
    """Grow `hashes` (a sequence's block hashes so far) to its first `num_blocks` full blocks;
    `cache_salt` goes into the first block's hash (and so, by the chain, into every block's)."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        if len(tokens) < block_size:
            raise ValueError(f"block {i} is not full ({len(tokens)} of {block_size} tokens)")
        hashes.append(hash_block(hashes[-1], tokens) if hashes else hash_block(ROOT_HASH, tokens, cache_salt))
    return hashes


def request_block_hashes(request, num_blocks: int, block_size: int) -> list[int]:
    """The hashes of a request's first `num_blocks` full blocks, its cache salt in them: computed once
    and kept on it (`request.block_hashes`; its tokens only grow, so they hold across preemption)."""
    if len(request.block_hashes) < num_blocks:
        extend_hashes(request.block_hashes, request.all_token_ids, block_size, num_blocks, request.params.cache_salt)
    return request.block_hashes[:num_blocks]

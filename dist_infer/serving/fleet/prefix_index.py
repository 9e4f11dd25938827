"""The front end's view of each instance's prefix cache: which full KV blocks it holds, by hash.

An instance names every full block it caches by the hash of its parent block's hash and its
token ids, the first block's with the request's cache salt (engine/prefix_cache.py), and reports
the hashes it stores and evicts, batched per step (wire.PrefixEvents). The front end hashes a
prompt with the same function and the same salt, so the blocks of it an
instance holds are the leading run of the prompt's hashes found in that instance's index: what
llm-d's precise prefix scorer and Dynamo's KV router read from their engines' KV events.

A request sent to an instance is expected to be cached there once it is prefilled, so its hashes
are added at dispatch (a burst sharing a prefix follows the first one instead of spreading before
any event arrives); an eviction event takes a hash out again. The index keeps at most `capacity`
hashes (least recently added or matched go first), so an instance that never reports cannot grow
it without bound. Pure bookkeeping, tested without processes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from dist_infer.engine.prefix_cache import extend_hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: Optional[str] = None) -> list[int]:
    """The hashes of the full blocks an instance could reuse for these tokens, salted as the
    instance salts them (the request's cache salt): all but the last token's (the engine always
    computes a prompt's last token, so it never matches that block)."""
    usable = max(0, (len(token_ids) - 1) // block_size)
    return extend_hashes([], token_ids, block_size, usable, cache_salt)


class PrefixIndex:
    """The block hashes one instance holds (as far as the front end knows)."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._hashes: "OrderedDict[int, None]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hashes

    def _add(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def apply(self, stored: Iterable[int], removed: Iterable[int]) -> None:
        """An instance's events: blocks it cached, blocks it evicted (in that order within a step)."""
        self._add(stored)
        for h in removed:
            self._hashes.pop(h, None)

    def expect(self, hashes: Sequence[int]) -> None:
        """A request with these prompt hashes was sent here: its blocks will be cached once prefilled."""
        self._add(hashes)

    def matched_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its hashes, in order) this instance holds."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        if n:
            self._add(hashes[:n])  # recently useful: kept longest
        return n

    def clear(self) -> None:
        """The instance restarted or died: its cache is gone."""
        self._hashes.clear()

"""The KV cache in fixed-size blocks, with a block table per sequence.

Blocks are the unit of everything that moves KV around: continuous batching allocates and
frees them per sequence, and migrating a running request copies them one by one. Each rank
holds its own layers (pipeline) and its own KV heads (tensor parallel).
"""

from __future__ import annotations

from typing import Optional

import torch

from dist_infer.engine.block_pool import BlockPool
from dist_infer.kernels.huge_pages import zeroed_pool


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class PagedKVCache:
    """Per-layer K and V tensors [num_blocks, block_size, kv_heads, head_dim] plus block tables."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        scratch: bool = False,
    ):
        """`scratch`: one more block than `num_blocks`, never allocated: where a bucketed decode
        step's padding rows write (engine/decode_graphs.py); `scratch_block` is its id."""
        self.block_size = block_size
        self.scratch_block = num_blocks if scratch else None
        shape = (num_blocks + int(scratch), block_size, kv_heads, head_dim)
        # one mapping on huge pages on the CPU: most of an instance's memory (kernels/huge_pages.py)
        pool = zeroed_pool(num_layers * 2 * shape[0] * block_size * kv_heads * head_dim, dtype, device)
        pool = pool.view(num_layers, 2, *shape)
        self.layers = [(pool[layer, 0], pool[layer, 1]) for layer in range(num_layers)]
        self.allocator = BlockPool(num_blocks)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def reserve(self, seq_id: int, new_tokens: int) -> list[int]:
        """Make room for `new_tokens` more tokens of `seq_id`; returns its block table."""
        table = self.tables.setdefault(seq_id, [])
        self.lengths.setdefault(seq_id, 0)
        need = blocks_for(self.lengths[seq_id] + new_tokens, self.block_size)
        while len(table) < need:
            table.append(self.allocator.allocate())
        return table

    def advance(self, seq_id: int, tokens: int) -> None:
        self.lengths[seq_id] += tokens

    def free(self, seq_id: int) -> None:
        self.allocator.free(self.tables.pop(seq_id, []))
        self.lengths.pop(seq_id, None)

    @property
    def bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)


def stacked_layers(cache_layers: list) -> Optional[torch.Tensor]:
    """The layers' K and V as one [layers, 2 (K, V), blocks, block_size, heads, head_dim] view, where
    they are evenly spaced views of one tensor (kv_cache.PagedKVCache's pool), else None. A stage's
    gather and scatter are then one op each instead of two per layer: in a mirroring round of a few
    blocks the ops' own overhead, not the bytes, is most of the copies' cost."""
    if not cache_layers:
        return None
    k0, v0 = cache_layers[0]
    storage = k0.untyped_storage().data_ptr()
    base, kv = k0.storage_offset(), v0.storage_offset() - k0.storage_offset()
    layer = cache_layers[1][0].storage_offset() - base if len(cache_layers) > 1 else 0
    for i, pair in enumerate(cache_layers):
        for j, t in enumerate(pair):
            if (
                t.untyped_storage().data_ptr() != storage
                or t.shape != k0.shape
                or t.stride() != k0.stride()
                or t.storage_offset() != base + i * layer + j * kv
            ):
                return None
    return k0.as_strided((len(cache_layers), 2, *k0.shape), (layer, kv, *k0.stride()), base)

"""The KV cache in fixed-size blocks, with a block table per sequence.

Blocks are the unit of everything that moves KV around: continuous batching allocates and
frees them per sequence, and migrating a running request copies them one by one. Each rank
holds its own layers (pipeline) and its own KV heads (tensor parallel).
"""

from __future__ import annotations

import mmap
from typing import Optional

import torch

from dist_infer.engine.block_pool import BlockPool

HUGE_PAGE_BYTES = 2 << 20


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def zeroed_pool(numel: int, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """`numel` zeros, on the CPU in an anonymous mapping of its own asked for transparent huge pages
    (where the kernel grants them: madvise). The KV cache is most of an instance's memory: in 4 KB
    pages a SIGKILLed process took ~100 ms to unmap them before its sockets closed, which its front
    end waited for before failing its requests over (docs/benchmarks.md, "KV mirroring"); in 2 MB
    pages it is a few ms, and attention over long contexts misses the TLB less."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    on_cpu = device is None or torch.device(device).type == "cpu"
    if not on_cpu or nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared would be shmem)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off in this kernel: 4 KB pages, as torch.zeros would have
        pass
    pool = torch.frombuffer(region, dtype=dtype, count=numel)  # holds the mapping while it lives
    return pool.zero_()  # touched now: the memory is taken at start, not at the first long request


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

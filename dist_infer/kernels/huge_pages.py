"""CPU memory on transparent huge pages (2 MB) for what stays for the process's life: the KV cache
and the weights.

In 4 KB pages a step that streams the weights (a decode) walks the page tables for every 4 KB it
reads, and a SIGKILLed process unmaps every page of its memory before its sockets close: ~100 ms
for a 1.5 GB instance, which its front end waited for before failing its requests over
(docs/benchmarks.md, "KV mirroring"). An anonymous private mapping asked for huge pages (madvise, so
THP's `madvise` mode grants it) takes both down. Temporaries stay in malloc's heap: torch's own
THP_MEM_ALLOC_ENABLE, which puts every large allocation on huge pages, slowed prompt steps, each
new temporary faulting 2 MB pages afresh.
"""

from __future__ import annotations

import itertools
import mmap
from typing import Optional

import torch
from torch import nn

HUGE_PAGE_BYTES = 2 << 20
SLOT_ALIGN = 64  # each weight starts on a cache line, as malloc's would


def huge_page_buffer(nbytes: int) -> Optional[torch.Tensor]:
    """`nbytes` uint8 of an anonymous private mapping asked for huge pages (faulted as it is
    written, zeros until then), or None where there is no such call (not Linux) or it is under a
    huge page. The tensor holds the mapping while it (or any view of it) lives."""
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared would be shmem)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off in this kernel: 4 KB pages, as malloc's would be
        pass
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)


def zeroed_pool(numel: int, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
    """`numel` zeros of `dtype`: on the CPU in a mapping of their own on huge pages (touched now, so
    the memory is taken at start), elsewhere (or small) as torch.zeros makes them."""
    on_cpu = device is None or torch.device(device).type == "cpu"
    size = torch.empty((), dtype=dtype).element_size()
    buffer = huge_page_buffer(numel * size) if on_cpu else None
    if buffer is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    return buffer.view(dtype).zero_()


def weights_on_huge_pages(module: nn.Module) -> int:
    """Move `module`'s contiguous CPU parameters and buffers into one mapping on huge pages, each
    tensor keeping its identity (its `.data` is swapped: tied weights stay tied, and whatever holds
    the tensor sees the new memory). One tensor at a time, so memory peaks at the weights plus the
    largest of them. Returns the bytes moved (0: nothing to move, or no huge pages here). Call it
    before anything keeps raw pointers to the weights (the native step plans at its first step)."""
    slots, total = [], 0
    for t in itertools.chain(module.parameters(), module.buffers()):  # (each shared one once)
        if t.device.type != "cpu" or not t.numel() or not t.is_contiguous():
            continue
        nbytes = t.numel() * t.element_size()
        slots.append((t, total, nbytes))
        total += -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN
    buffer = huge_page_buffer(total)
    if buffer is None:
        return 0
    with torch.no_grad():
        for t, offset, nbytes in slots:
            moved = buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
            moved.copy_(t)
            t.data = moved
    return total

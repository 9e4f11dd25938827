"""Keep freed activation memory in the process (glibc malloc), so a step's large temporaries do
not page-fault afresh every time.

glibc serves large allocations (above a threshold that starts at 128 KB) with mmap and gives
them back with munmap; every new [tokens, hidden] activation of a prefill then costs a page
fault per 4 KB touched. Raising the mmap and trim thresholds keeps such buffers in the heap for
reuse. This shortened a tp=2 prefill (docs/benchmarks.md, "Tensor parallel Llama inference against
DeepSpeed AutoTP and transformers"), and CPU inference stacks recommend the same (tcmalloc, jemalloc).
Process-wide, so the engine does it once when it is created; DIST_INFER_MALLOC_TUNING=0 leaves
the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from loguru import logger

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 256 << 20  # allocations below this come from the reusable heap
TRIM_THRESHOLD_BYTES = 1 << 30  # free heap kept before memory is returned to the system

_done = False


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where it does not apply."""
    global _done
    if _done or os.environ.get("DIST_INFER_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
        )
    except (OSError, AttributeError):  # not glibc (musl, another libc): nothing to tune
        ok = False
    logger.debug(f"glibc malloc thresholds {'raised' if ok else 'left as they are'}")
    _done = ok
    return ok

"""This host's cores as a process may use them, and each local rank's share of them."""

from __future__ import annotations

import os
from typing import Optional


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under a batch scheduler), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_rank(nproc_local: int, cpus: Optional[int] = None) -> int:
    """Cores each local rank may use: the node's usable cores shared evenly, at least one."""
    cpus = cpus or usable_cores()
    return max(1, cpus // max(1, nproc_local))

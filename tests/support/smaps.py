"""What this process's /proc/self/smaps says of the mapping holding an address."""

from __future__ import annotations

import os
from typing import Optional

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_eligible(address: int) -> Optional[bool]:
    """THPeligible of the mapping holding `address` (None: not found)."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= address < hi
            elif current and head == "THPeligible:":
                return line.split()[1] == "1"
    return None


def thp_on() -> Optional[bool]:
    """Whether the kernel grants transparent huge pages to a mapping that asks (None: no THP here)."""
    if not os.path.exists(THP_ENABLED):
        return None
    with open(THP_ENABLED) as f:
        return "[never]" not in f.read()

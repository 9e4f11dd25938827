"""Who mirrors to whom: each instance's buddy, on another node where there is one.

The instances are laid out round-robin over their nodes (the instances of the node with the most
first) and each mirrors to the next one in that ring: with two nodes or more no instance mirrors
to its own node unless one node holds more than half of them, and the ring is the same whenever
the same instances serve (the pairs change only when instances come or go)."""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence


def pair_buddies(instances: Sequence[tuple[int, Optional[str]]]) -> dict[int, int]:
    """instance index -> its buddy's, for `instances` given as (index, node); none for a lone one."""
    by_node: dict[Optional[str], list[int]] = defaultdict(list)
    for index, node in sorted(instances, key=lambda x: x[0]):
        by_node[node].append(index)
    nodes = sorted(by_node.values(), key=lambda group: (-len(group), group[0]))
    ring: list[int] = []
    for i in range(max((len(g) for g in nodes), default=0)):
        ring += [g[i] for g in nodes if i < len(g)]
    if len(ring) < 2:
        return {}
    return {ring[i]: ring[(i + 1) % len(ring)] for i in range(len(ring))}

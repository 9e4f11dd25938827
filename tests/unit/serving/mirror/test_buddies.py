"""Buddy pairing (serving/mirror/buddies.py): every instance mirrors to one other, on another node
where one exists, and the pairs depend only on which instances serve."""

from __future__ import annotations

import pytest

from dist_infer.serving.mirror.buddies import pair_buddies


@pytest.mark.parametrize(
    "instances",
    [
        [(0, "a"), (1, "a")],
        [(0, "a"), (1, "a"), (2, "b"), (3, "b")],
        [(0, "a"), (1, "b"), (2, "c")],
        [(3, "b"), (0, "a"), (2, "a"), (1, "b"), (5, "c")],
    ],
)
def test_each_instance_has_one_buddy_and_is_one_buddy(instances):
    pairs = pair_buddies(instances)
    indexes = sorted(i for i, _ in instances)
    assert sorted(pairs) == indexes and sorted(pairs.values()) == indexes
    assert all(src != buddy for src, buddy in pairs.items())
    assert pair_buddies(list(reversed(instances))) == pairs, "the order they are listed in does not matter"


def test_buddies_sit_on_another_node_where_there_is_one():
    node = {0: "a", 1: "a", 2: "b", 3: "b"}
    pairs = pair_buddies(list(node.items()))
    assert all(node[src] != node[buddy] for src, buddy in pairs.items()), pairs
    node = {0: "a", 1: "a", 2: "a", 3: "b"}  # three on a, one on b: b takes one of a's, the least there is
    pairs = pair_buddies(list(node.items()))
    assert sum(node[s] == node[b] for s, b in pairs.items()) == 2, pairs


def test_a_lone_instance_has_no_buddy():
    assert pair_buddies([(0, "a")]) == {} and pair_buddies([]) == {}

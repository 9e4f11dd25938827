"""Where a layout's groups fall on nodes: whether a group crosses nodes, and its ranks per node."""

from __future__ import annotations

from dist_infer.planner.layout import Layout
from dist_infer.planner.rank_rates import group_placement


def test_group_placement_on_nodes():
    assert group_placement(Layout(tp=8), "tp", 8) == (False, 8)
    assert group_placement(Layout(tp=16), "tp", 8) == (True, 8)
    assert group_placement(Layout(tp=8, cp=4), "cp", 8) == (True, 1)  # one GPU per node in each cp ring
    assert group_placement(Layout(tp=2, cp=2), "cp", 8) == (False, 2)

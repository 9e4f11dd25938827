"""The expert routing file: written with counts and placements, read back for the same ep or
recomputed for another, and a file for another model or of another kind refused by name."""

from __future__ import annotations

import json

import pytest

from dist_infer.parallel.moe.placement import balanced_placement
from dist_infer.parallel.moe.routing_file import read_placement_file, write_routing_file


def test_routing_file_round_trip(tmp_path):
    counts = {0: [100, 90, 10, 5, 4, 3, 2, 1], 3: [1, 1, 1, 1, 1, 1, 1, 50]}
    path = tmp_path / "routing.json"
    data = write_routing_file(path, counts, ep=2)
    on_disk = json.loads(path.read_text())
    assert on_disk["counts"]["0"] == [100, 90, 10, 5, 4, 3, 2, 1]
    assert on_disk["imbalance_balanced"]["0"] < on_disk["imbalance_contiguous"]["0"]
    same_ep = read_placement_file(path, 8, 2)
    assert same_ep[0].owner == tuple(data["placement"]["0"]) and set(same_ep) == {0, 3}
    other_ep = read_placement_file(path, 8, 4)  # recomputed from the counts
    assert other_ep[0].owner == tuple(balanced_placement(counts[0], 4))
    with pytest.raises(ValueError, match="for 8 experts per layer, the model has 16"):
        read_placement_file(path, 16, 2)
    (tmp_path / "bad.json").write_text('{"kind": "something else"}')
    with pytest.raises(ValueError, match="not an expert routing file"):
        read_placement_file(tmp_path / "bad.json", 8, 2)

"""Layout arithmetic and the mesh's rank layout and groups."""

from __future__ import annotations

import itertools

import pytest

from dist_infer.topology.layout import Layout, LayoutError
from dist_infer.topology.mesh import RANK_ORDER, Mesh

# -- Layout.sizes ------------------------------------------------------------------------------


def test_dp_derived():
    assert Layout(tp=2).sizes(8) == {"tp": 2, "cp": 1, "ep": 1, "dp": 4, "pp": 1}
    assert Layout(tp=2, pp=2).sizes(4)["dp"] == 1
    assert Layout().sizes(3) == {"tp": 1, "cp": 1, "ep": 1, "dp": 3, "pp": 1}
    assert Layout(tp=2, pp=3, ep=2, cp=2).sizes(48)["dp"] == 2


def test_explicit_dp_matching():
    assert Layout(tp=2, dp=2).sizes(4)["dp"] == 2


def test_tp_not_dividing_world_shows_arithmetic():
    with pytest.raises(LayoutError) as info:
        Layout(tp=3).sizes(4)
    message = str(info.value)
    assert "tp=3" in message and "world size 4" in message
    assert "4 % 3 = 1" in message


def test_product_not_dividing_world_shows_arithmetic():
    with pytest.raises(LayoutError) as info:
        Layout(tp=2, pp=2, ep=2).sizes(12)
    message = str(info.value)
    assert "tp=2 x pp=2 x ep=2 x cp=1 = 8" in message
    assert "12 % 8 = 4" in message


def test_explicit_dp_mismatch_shows_arithmetic():
    with pytest.raises(LayoutError) as info:
        Layout(tp=2, dp=3).sizes(4)
    message = str(info.value)
    assert "dp=3 = 6" in message and "world size is 4" in message


def test_explicit_dp_too_small():
    with pytest.raises(LayoutError, match=r"= 2, but the world size is 4"):
        Layout(tp=2, dp=1).sizes(4)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"tp": 0}, "tp=0"),
        ({"pp": -1}, "pp=-1"),
        ({"ep": 0}, "ep=0"),
        ({"cp": 1.5}, "cp=1.5"),
        ({"dp": 0}, "dp=0"),
    ],
)
def test_non_positive_sizes(kwargs, name):
    with pytest.raises(LayoutError, match=rf"{name}.*positive integer"):
        Layout(**kwargs).sizes(4)


def test_mesh_build_validates():
    with pytest.raises(LayoutError):
        Mesh.build(Layout(tp=3), 4)


# -- rank layout ---------------------------------------------------------------------------

CONFIGS = [
    (Layout(), 1),
    (Layout(), 4),
    (Layout(tp=2, pp=2), 4),
    (Layout(tp=2), 8),
    (Layout(tp=2, pp=2, ep=2), 8),
    (Layout(tp=2, cp=2, ep=2, pp=2, dp=2), 32),
    (Layout(tp=3, pp=2), 12),
    (Layout(tp=1, cp=3, ep=1, pp=1), 6),
]
IDS = [f"{m}w{w}" for m, w in [(f"tp{c.tp}pp{c.pp}ep{c.ep}cp{c.cp}dp{c.dp}", w) for c, w in CONFIGS]]


@pytest.mark.parametrize("config,world", CONFIGS, ids=IDS)
def test_rank_order_formula(config, world):
    mesh = Mesh.build(config, world)
    s = mesh.sizes
    assert mesh.world_size == world
    seen = set()
    for pp_i, dp_i, ep_i, cp_i, tp_i in itertools.product(*(range(s[a]) for a in ("pp", "dp", "ep", "cp", "tp"))):
        rank = tp_i + s["tp"] * (cp_i + s["cp"] * (ep_i + s["ep"] * (dp_i + s["dp"] * pp_i)))
        coords = {"tp": tp_i, "cp": cp_i, "ep": ep_i, "dp": dp_i, "pp": pp_i}
        assert mesh.coords(rank) == coords
        assert mesh.rank_of(coords) == rank
        seen.add(rank)
    assert seen == set(range(world))


def test_tp_innermost_pp_outermost():
    mesh = Mesh.build(Layout(tp=2, pp=2), 8)  # dp = 2
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups("cp") == [[r] for r in range(8)]
    assert mesh.describe() == "tp=2,pp=2,dp=2"
    assert mesh.layout == Layout(tp=2, pp=2, dp=2)


def test_axis_order_constant():
    assert RANK_ORDER == ("tp", "cp", "ep", "dp", "pp")
    mesh = Mesh.build(Layout(tp=2, cp=2, ep=2, pp=2, dp=2), 32)
    assert mesh.coords(1) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 0}
    assert mesh.coords(2) == {"tp": 0, "cp": 1, "ep": 0, "dp": 0, "pp": 0}
    assert mesh.coords(4) == {"tp": 0, "cp": 0, "ep": 1, "dp": 0, "pp": 0}
    assert mesh.coords(8) == {"tp": 0, "cp": 0, "ep": 0, "dp": 1, "pp": 0}
    assert mesh.coords(16) == {"tp": 0, "cp": 0, "ep": 0, "dp": 0, "pp": 1}


@pytest.mark.parametrize("config,world", CONFIGS, ids=IDS)
def test_groups_partition_the_world_and_match_coords(config, world):
    mesh = Mesh.build(config, world)
    for axis in RANK_ORDER:
        groups = mesh.groups(axis)
        assert groups == sorted(groups)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(world)), f"{axis} groups do not partition the world"
        assert len(groups) == world // mesh.sizes[axis]
        for group in groups:
            assert len(group) == mesh.sizes[axis]
            coords = [mesh.coords(r) for r in group]
            # group rank i has axis coordinate i, and every other coordinate is shared
            assert [c[axis] for c in coords] == list(range(mesh.sizes[axis]))
            for other in RANK_ORDER:
                if other != axis:
                    assert len({c[other] for c in coords}) == 1
            for r in group:
                assert mesh.group_of(axis, r) == group


def test_coords_outside_world_and_unknown_axis():
    mesh = Mesh.build(Layout(tp=2), 4)
    with pytest.raises(ValueError, match="rank 4 outside world size 4"):
        mesh.coords(4)
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        mesh.groups("xp")


@pytest.mark.parametrize(
    "tp,world,local,crosses",
    [
        (2, 4, 2, False),
        (2, 8, 4, False),
        (4, 8, 4, False),
        (4, 8, 2, True),
        (2, 6, 3, True),  # ranks 2,3 straddle nodes 0 and 1
        (1, 4, 1, False),
        (8, 8, 8, False),
    ],
)
def test_tp_crosses_nodes(tp, world, local, crosses):
    assert Mesh.build(Layout(tp=tp), world).tp_crosses_nodes(local) is crosses

"""The one layout syntax: `tp=2,pp=2` everywhere, `tp2pp2` as an alias, and --instances lists of
both; errors name the bad part. Pure Python: no torch, no ranks."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, strategies as st

from dist_infer.serving.fleet.instance_specs import InstancesError, InstanceSpec, check_world, parse_instances
from dist_infer.serving.fleet.wire import Role
from dist_infer.topology import Layout, LayoutError, parse_layout
from dist_infer.topology.layout import DISPLAY_ORDER
from dist_infer.topology.mesh import RANK_ORDER

# -- parse_layout ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "canonical, compact",
    [
        ("tp=2,pp=2", "tp2pp2"),
        ("tp=2", "tp2"),
        ("pp=2", "pp2"),
        ("tp=2,cp=2,ep=2", "tp2cp2ep2"),
        ("tp=8,cp=2", "cp2tp8"),
        ("tp=1", "tp1"),
        ("tp=2,dp=3", "tp2dp3"),
    ],
)
def test_both_syntaxes_give_the_same_layout(canonical, compact):
    assert parse_layout(canonical) == parse_layout(compact)
    assert parse_layout(canonical.replace(",", " ")) == parse_layout(canonical)  # spaces for commas
    assert parse_layout(compact).describe() == canonical


def test_describe_is_canonical():
    assert Layout().describe() == "tp=1"
    assert Layout(ep=4, tp=2).describe() == "tp=2,ep=4"  # display order, whatever the keyword order
    assert Layout(tp=2, dp=1).describe() == "tp=2,dp=1"  # dp=1 (exactly one replica) is not dp left out
    assert Layout(tp=2, pp=2).as_dict() == {"tp": 2, "pp": 2, "cp": 1, "ep": 1}
    assert Layout(dp=2).as_dict()["dp"] == 2
    assert Layout(tp=2, pp=3, cp=5, ep=7).ranks == 210


sizes = st.integers(min_value=1, max_value=64)


@given(sizes, sizes, sizes, sizes, st.one_of(st.none(), sizes))
def test_parse_describe_round_trip(tp, pp, cp, ep, dp):
    layout = Layout(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp)
    assert parse_layout(layout.describe()) == layout
    compact = "".join(f"{a}{v}" for a, v in layout.as_dict().items())
    assert parse_layout(compact) == layout


@pytest.mark.parametrize(
    "text, named, why",
    [
        ("tp=two", "'tp=two'", "'two' is not an integer"),
        ("tp=2,xp=2", "'xp=2'", "unknown axis 'xp'"),
        ("tp=0", "'tp=0'", "positive"),
        ("tp2pp", "'tp2pp'", "write e.g. tp=2,pp=2"),
        ("tp2 pp=-1", "'pp=-1'", "positive"),
        ("tp=2,tp=4", "'tp=4'", "tp is given twice"),
        ("tp2tp4", "'tp2tp4'", "tp is given twice"),
        ("", "''", "empty layout"),
    ],
)
def test_errors_name_the_bad_part(text, named, why):
    with pytest.raises(LayoutError) as info:
        parse_layout(text)
    assert named in str(info.value) and why in str(info.value), str(info.value)


def test_display_and_rank_orders_are_different_things():
    assert DISPLAY_ORDER == ("tp", "pp", "cp", "ep", "dp")  # how a layout is written
    assert RANK_ORDER == ("tp", "cp", "ep", "dp", "pp")  # which axis varies fastest along the ranks
    assert set(DISPLAY_ORDER) == set(RANK_ORDER)


# -- --instances -------------------------------------------------------------------------------


def spec(role: str = "mixed", **axes) -> InstanceSpec:
    return InstanceSpec(Layout(**axes), Role(role))


@pytest.mark.parametrize(
    "text",
    [
        "prefill:tp=2,pp=2; decode:tp=1; decode:tp=1",
        "prefill:tp=2,pp=2 decode:tp=1 decode:tp=1",  # spaces separate items too
        " prefill: tp=2, pp=2 ;decode:tp=1;  decode:tp=1 ",  # spaces around the punctuation are fine
        "prefill:tp2pp2,decode:tp1,decode:tp1",  # the older comma list of compact layouts
        "prefill:tp2pp2; decode:tp=1, decode:tp1",  # mixed forms
    ],
)
def test_instances_both_forms(text):
    assert parse_instances(text) == [spec("prefill", tp=2, pp=2), spec("decode"), spec("decode")]


def test_instances_comma_lists():
    # compact items and role prefixes start an item; an axis=n part joins the axis=n item before it
    assert parse_instances("tp2,tp1,tp2pp2") == [spec(tp=2), spec(), spec(tp=2, pp=2)]
    assert parse_instances("tp2pp2, pp2") == [spec(tp=2, pp=2), spec(pp=2)]
    assert parse_instances("tp=2,pp=2,decode:tp=1") == [spec(tp=2, pp=2), spec("decode")]
    assert parse_instances("tp2,pp=2") == [spec(tp=2), spec(pp=2)]
    assert parse_instances("3", tp=2) == [spec(tp=2)] * 3
    assert parse_instances("2", tp=2, pp=2) == [spec(tp=2, pp=2)] * 2


def test_instance_spec_describe_reads_back():
    specs = parse_instances("prefill:tp2pp2; mixed:tp1; decode:pp=3")
    assert [s.describe() for s in specs] == ["prefill:tp=2,pp=2", "tp=1", "decode:pp=3"]
    for s in specs:  # `serve --join` is started with --instances <describe()>
        assert parse_instances(s.describe()) == [s]
    assert parse_instances("; ".join(s.describe() for s in specs)) == specs


def test_instance_spec_attributes_and_older_constructor():
    s = spec("prefill", tp=2, pp=3)
    assert (s.tp, s.pp, s.size, s.role, s.layout) == (2, 3, 6, Role.PREFILL, "tp=2,pp=3")
    assert isinstance(s.layout, str)  # it travels in the Hello and the /admin status as text
    assert s.parallel == Layout(tp=2, pp=3)
    # InstanceSpec(tp, pp, role), as a driver's Hello and older callers build it
    assert InstanceSpec(2, 3, "prefill") == s
    assert InstanceSpec(2) == spec(tp=2) and InstanceSpec(1, 2) == spec(pp=2)
    assert InstanceSpec(Layout(tp=2), role="decode") == spec("decode", tp=2)
    assert InstanceSpec() == spec()


def test_instance_spec_mixed_forms_are_refused():
    with pytest.raises(TypeError, match="already has its pp"):
        InstanceSpec(Layout(tp=2), 2)  # a layout and a pp: the layout says its pp
    with pytest.raises(TypeError, match="already has its pp"):
        InstanceSpec(Layout(tp=2), 2, "decode")
    with pytest.raises(TypeError, match="pp is a count"):
        InstanceSpec(2, "decode")  # a role where the pp goes


@pytest.mark.parametrize(
    "text, named",
    [
        ("tp2,,tp1", "empty item"),
        ("tp=2;;tp=1", "empty item"),
        ("tpx", "'tpx'"),
        ("tp=2; tp=x", "'tp=x'"),
        ("0", "from 1 to 1024 instances"),
        ("100000000000", "from 1 to 1024 instances"),
        ("tp0", "'tp0'"),
        ("prefil:tp1", "unknown role 'prefil'"),
        ("prefill:", "empty layout"),
        ("tp=2,tp=1", "tp is given twice"),
        ("dp2", "dp=2"),
        ("tp=2,cp=2", "cp=2"),
        ("decode:tp2ep4", "ep=4"),
    ],
)
def test_instances_errors_name_the_bad_part(text, named):
    with pytest.raises(InstancesError) as info:
        parse_instances(text)
    message = str(info.value)
    assert named in message and text in message, message


def test_instances_unserved_axes_name_what_runs():
    with pytest.raises(InstancesError, match=r"asks for cp=2, ep=2: an instance runs tp and pp only"):
        parse_instances("tp2cp2ep2")
    with pytest.raises(InstancesError, match="more replicas are more items"):
        parse_instances("tp=1,dp=2")


def test_check_world_prints_canonical_layouts():
    with pytest.raises(InstancesError, match=r"2 \(tp=2\) \+ 1 \(tp=1\) = 3 ranks, the job has 4"):
        check_world(parse_instances("tp2,tp1"), 4)


def test_every_small_layout_round_trips_through_instances():
    for tp, pp in itertools.product((1, 2, 3, 8), repeat=2):
        for role in Role:
            s = spec(role.value, tp=tp, pp=pp)
            assert parse_instances(s.describe()) == [s]

"""The planner's layouts: parsing (and the compact alias), sweeps, errors that name the bad part,
and the candidates: exactly the layouts the engine runs, with why each other one does not."""

from __future__ import annotations

import pytest

from dist_infer.planner.layout import Layout, LayoutError, candidate_layouts, parse_layout, parse_sweep, why_not
from tests.support.plan_profiles import SMALL


def test_layout_parsing_and_errors():
    assert parse_layout("tp=8,cp=2") == Layout(tp=8, cp=2)
    assert parse_layout("tp=2 pp=2") == Layout(tp=2, pp=2)
    assert parse_layout("tp8cp2") == Layout(tp=8, cp=2)  # the compact alias
    for bad, said in (("tp=two", "'two' is not an integer"), ("xp=2", "axes: tp, pp, cp, ep"), ("tp=0", "positive")):
        with pytest.raises(LayoutError, match=said):
            parse_layout(bad)
    assert len(parse_sweep("tp=1,2 pp=1,2 cp=1,2")) == 8
    with pytest.raises(LayoutError, match="bad sweep part"):
        parse_sweep("tp=1,2 pp")


def test_candidate_layouts_are_what_the_engine_runs():
    lays = candidate_layouts(SMALL, 4)
    assert all(lay.ranks == 4 for lay in lays)
    assert Layout(tp=2, pp=2) in lays and Layout(tp=4) in lays and Layout(cp=4) in lays
    assert Layout(pp=2, cp=2) not in lays  # cp with pp is not supported
    assert why_not(Layout(tp=8), SMALL) == "tp=8 is more than the 4 query heads"
    assert "needs 2 ranks" in why_not(Layout(tp=2), SMALL, 4)
    assert why_not(Layout(ep=2), SMALL).startswith("ep=2 needs a mixture-of-experts")
    assert why_not(Layout(tp=2, dp=2), SMALL).startswith("dp=2: a plan is for one replica")
    assert why_not(Layout(tp=2, dp=1), SMALL) is None

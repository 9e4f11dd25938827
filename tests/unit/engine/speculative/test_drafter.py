"""The scheduler's drafter: proposals from a request's history kept in step with its ids (rebuilt
when they disagree, as for a migrated or resumed request), cut to the limit and the model's
positions, none for structured outputs; the counters and the proposal length follow each round;
a bad config is refused by the flag's name."""

from __future__ import annotations

import pytest

from dist_infer.engine.request import Request
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.speculative.config import SpeculativeConfig
from dist_infer.engine.speculative.counters import SpeculativeCounters
from dist_infer.engine.speculative.drafter import NgramDrafter
from dist_infer.engine.structured.spec import StructuredSpec


def _request(prompt, output=(), rid="r", **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_new_tokens=64, **params), seed=0)
    r.output_token_ids = list(output)
    return r


def _drafter(k=4, max_positions=1000, **kw):
    counters = SpeculativeCounters(k)
    return NgramDrafter(
        SpeculativeConfig(num_tokens=k, ngram_min=1, ngram_max=3, **kw), max_positions, counters
    ), counters


def test_proposals_follow_the_requests_ids_as_they_grow():
    drafter, _ = _drafter()
    r = _request([1, 2, 3, 4, 5, 6, 1, 2])
    assert drafter.propose(r, 10) == [3, 4, 5, 6]
    r.output_token_ids += [3, 4, 9, 1]
    assert drafter.propose(r, 10) == [2, 3, 4, 9], "the output is part of the history"
    assert drafter.propose(r, 2) == [2, 3], "cut to the limit"


def test_a_history_that_is_not_the_requests_is_rebuilt():
    drafter, _ = _drafter()
    long = _request([1, 2, 3, 1, 2], output=[3, 1, 2, 3, 1])
    drafter.propose(long, 4)
    again = _request([5, 6, 7, 5, 6], rid="r")  # same id, a shorter history (a new request of that id)
    assert drafter.propose(again, 4) == [7, 5, 6]


def test_no_proposal_past_the_models_positions_nor_for_structured_outputs():
    drafter, _ = _drafter(max_positions=10)
    r = _request([1, 2, 3, 4, 1, 2, 3, 4])
    assert drafter.propose(r, 8) == [1, 2], "10 positions - 8 tokens"
    structured = _request([1, 2, 1, 2], rid="s", structured=StructuredSpec(kind="regex", value="[ab]+"))
    assert drafter.propose(structured, 4) == []


def test_rounds_feed_the_counters_and_the_length():
    drafter, counters = _drafter(k=4)
    r = _request([1, 2, 3, 4, 5, 1, 2])
    assert len(drafter.propose(r, 8)) == 4
    drafter.record(r, 4, 1)
    assert counters.snapshot() == {
        "num_drafts": 1,
        "num_draft_tokens": 4,
        "num_accepted_tokens": 1,
        "accepted_per_pos": [1, 0, 0, 0],
    }
    assert len(drafter.propose(r, 8)) == 4, "rows that cost nothing: K again"
    drafter.row_cost = 0.5
    assert len(drafter.propose(r, 8)) == 1, "kept 1 of 4 (acceptance 0.65): one pays at half a token a row"
    drafter.record(r, 2, 0)
    assert counters.acceptance_rate == pytest.approx(1 / 6)
    drafter.forget(r)
    assert len(drafter) == 0


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(num_tokens=0), "--num-speculative-tokens"),
        (dict(num_tokens=17), "--num-speculative-tokens"),
        (dict(ngram_min=0), "--ngram-min"),
        (dict(ngram_min=3, ngram_max=2), "--ngram-max"),
        (dict(method="eagle"), "speculative method"),
    ],
)
def test_a_bad_config_names_its_flag(kw, name):
    with pytest.raises(ValueError, match=name):
        SpeculativeConfig(**kw)

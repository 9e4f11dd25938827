"""The step's masks: the parallel fill equal to each row alone, the fill started on the filler's
thread equal to the one done in place and counted (its wait too), a fill that raises handed to the
sampler, and min_tokens' ban on EOS lifted exactly where the grammar can only end."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from dist_infer.engine.structured.compiler import GrammarCompiler
from dist_infer.engine.structured.counters import StructuredCounters
from dist_infer.engine.structured.mask_filler import MaskFiller, lift_eos_bans, only_ending
from dist_infer.engine.structured.spec import StructuredSpec

VOCAB, EOS = 1024, 1
SPECS = [
    StructuredSpec.from_kind("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}}}),
    StructuredSpec.from_kind("regex", "[a-z ]{1,12}"),
    StructuredSpec.from_kind("choice", ["the river", "the town", "snow"]),
    StructuredSpec.from_kind("json_object"),
]


@pytest.fixture(scope="module")
def compiler(text_tokenizer):
    return GrammarCompiler(lambda: text_tokenizer, VOCAB, (EOS,))


def one_row(matcher) -> torch.Tensor:
    row = torch.zeros(1, matcher.words, dtype=torch.int32)
    matcher.fill_mask(row, 0)
    return row[0]


def test_the_parallel_fill_equals_each_row_alone(compiler):
    matchers = [compiler.matcher(s) for s in SPECS]
    filled = MaskFiller(threads=2).fill(matchers)
    assert filled.shape == (4, matchers[0].words)
    for i, m in enumerate(matchers):
        assert torch.equal(filled[i], one_row(m)), SPECS[i]
    assert torch.equal(MaskFiller().fill(matchers[:1])[0], filled[0]), "one row: filled directly"


def test_a_started_fill_equals_the_fill_in_place_and_is_counted(compiler):
    counters = StructuredCounters()
    filler = MaskFiller(counters=counters)
    matchers = [compiler.matcher(s) for s in SPECS]
    try:
        pending = filler.start([3, 0, 5, 1], matchers)
        assert pending.rows == [3, 0, 5, 1]
        assert torch.equal(pending.result(), MaskFiller().fill(matchers))
        done = counters.snapshot()
        assert done["mask_steps"] == 1 and done["mask_rows"] == 4
        assert done["mask_seconds"] > 0 and done["mask_wait_seconds"] >= 0
    finally:
        filler.close()


def test_the_fill_runs_beside_its_caller_and_a_fill_that_raises_reaches_the_sampler(compiler):
    """The caller goes on while the fill waits (here on an event the caller sets); an error in the
    fill is raised by result(), and settle() waits without raising."""
    gate = threading.Event()

    class Gated:
        words = compiler.matcher(SPECS[3]).words

        def fill_mask(self, bitmask, row):
            assert gate.wait(60), "the caller never went on"
            raise RuntimeError("the grammar broke")

    filler = MaskFiller()
    try:
        pending = filler.start([0], [Gated()])
        gate.set()  # reached only because start() returned before the fill ended
        with pytest.raises(RuntimeError, match="the grammar broke"):
            pending.result()
        again = filler.start([0], [Gated()])
        again.settle()  # no raise
    finally:
        filler.close()


def test_only_ending_finds_rows_that_allow_nothing_but_eos(compiler, text_tokenizer):
    spec = StructuredSpec.from_kind("choice", ["the river"])
    open_ = compiler.matcher(spec)
    done = compiler.matcher(spec, text_tokenizer.encode("the river", add_bos=False))
    masks = MaskFiller().fill([open_, done])
    assert only_ending(masks, [EOS]) == [False, True]


def test_the_eos_ban_is_lifted_only_where_the_grammar_can_only_end(compiler, text_tokenizer):
    spec = StructuredSpec.from_kind("choice", ["the river"])
    ids = text_tokenizer.encode("the river", add_bos=False)
    masks = MaskFiller().fill([compiler.matcher(spec), compiler.matcher(spec, ids), compiler.matcher(spec, ids)])
    rows = [
        SimpleNamespace(ban_eos=1),
        SimpleNamespace(ban_eos=1),
        SimpleNamespace(ban_eos=1),
        SimpleNamespace(ban_eos=0),
    ]
    lift_eos_bans(rows, [0, 1, 3], masks, [EOS])  # plan rows 0, 1 and 3 are masked; row 2 is not
    assert [r.ban_eos for r in rows] == [1, 0, 1, 0]

"""The structured-output counters: named adds from several threads sum exactly; a misspelt name
raises instead of being lost."""

from __future__ import annotations

import threading

import pytest

from dist_infer.engine.structured.counters import StructuredCounters


def test_adds_from_many_threads_sum_exactly():
    counters = StructuredCounters()

    def work():
        for _ in range(1000):
            counters.add(mask_rows=2, mask_seconds=0.5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = counters.snapshot()
    assert snap["mask_rows"] == 8000 and snap["mask_seconds"] == 2000.0
    assert set(snap) == {
        "grammar_compiles",
        "grammar_compile_seconds",
        "grammar_cache_hits",
        "matchers_started",
        "mask_steps",
        "mask_rows",
        "mask_seconds",
        "mask_wait_seconds",
    }


@pytest.mark.parametrize("name", ["mask_row", "_lock", "snapshot"])
def test_a_name_that_is_no_counter_raises(name):
    with pytest.raises(AttributeError, match="no structured-output counter"):
        StructuredCounters().add(**{name: 1})

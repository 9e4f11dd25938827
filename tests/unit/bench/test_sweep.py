"""bench --sweep: each layout's child command drops the flags the sweep sets itself."""

from __future__ import annotations

from dist_infer.bench.sweep import child_argv


def test_sweep_child_argv_drops_what_each_run_sets():
    argv = ["bench", "--model", "tiny", "--sweep", "tp=1,2", "--tp", "2", "--json", "--plot=x.png", "--batch", "2"]
    assert child_argv(argv) == ["--model", "tiny", "--batch", "2"]

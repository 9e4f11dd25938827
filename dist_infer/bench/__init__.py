"""`dist-infer bench`: prefill and decode throughput, side by side with the peers in the same run.

Our engine runs the workload first (all ranks), then rank 0 runs each peer named by --compare
in its own processes, one after another so they never share the cores, and reports our numbers
as ratios to theirs. Every system gets the same prompts (seeded B x P random ids) and the same
greedy loop shape: one prefill, then G-1 decode steps.

One module each: `flags` (the command line), `timing` (the timed runs), `memory` (the peak of
generation itself), `overlap` (how much communication is hidden, per group), `report` (ratios,
the PNG, the routing file), `run` (the command: ours, then the peers), `profile` (`--profile`: where
one rank's time goes), `sweep` (`--sweep`: every layout, measured beside the planner's prediction),
`peers` (the other systems, each in its own processes) and `serve` (`dist-infer bench-serve`: a load
generator for any OpenAI-compatible server, split into datasets, arrivals, the client and the report).

One layer with `planner`, below `cli` and `launch`: it imports neither. The CLI adds the model flags
and hands `run_bench` each rank's start (`RankStart`: join the job, load the shard, build the engine);
child jobs, cores and process groups come from `topology`.
"""

from __future__ import annotations

from dist_infer.bench.flags import COMPARABLE, add_bench_flags, parse_compare
from dist_infer.bench.overlap import report_runs
from dist_infer.bench.run import RankStart, run_bench

__all__ = ["COMPARABLE", "RankStart", "add_bench_flags", "parse_compare", "report_runs", "run_bench"]

"""The flags of `dist-infer bench` and the --compare list."""

from __future__ import annotations

import argparse

from dist_infer.arg_types import positive_int

COMPARABLE = ("deepspeed", "hf", "hf-compiled", "hf-tp", "ladder", "layered", "llama.cpp", "ours-1proc")


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    """The bench's own flags; the model and layout flags, the same as generate's and serve's, are
    the rank start-up's (`launch.model_options.add_model_flags`), which the CLI adds before these."""
    _add_workload_flags(p)
    _add_compare_flags(p)
    _add_analysis_flags(p)
    _add_output_flags(p)
    _add_sweep_flags(p)
    _add_routing_flags(p)


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The workload our engine is timed on: the batch, the prompt and output lengths, the runs."""
    p.add_argument("--batch", type=positive_int, default=4, help="prompts per batch (default %(default)s)")
    p.add_argument("--prompt-len", type=positive_int, default=256, help="tokens per prompt (default %(default)s)")
    p.add_argument("--gen-len", type=positive_int, default=32, help="new tokens per prompt (default %(default)s)")
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="timed runs of our engine; the best is reported (default %(default)s)",
    )


def _add_compare_flags(p: argparse.ArgumentParser) -> None:
    """The peers and variants run beside our engine, the step's token budget (the layered variant
    needs one) and how long each peer may take."""
    p.add_argument(
        "--compare",
        default="",
        help="peers to run in the same invocation, comma separated: deepspeed (AutoTP, tp ranks), "
        "hf (transformers, one process, on our --device in our --dtype), hf-tp (transformers "
        "tp_plan=auto, tp ranks), llama.cpp (llama-bench / llama-batched-bench on the same GGUF file and as many cores as our "
        "run; `make llama-cpp` builds them), ours-1proc (this engine in one process on all cores), ladder "
        "(this engine, the same layout and workload, every decoder layer a Ladder Residual layer: "
        "what overlapping each all-reduce with the next module buys; for measurements, since a "
        "standard checkpoint run as a ladder computes a different function), layered (this engine, "
        "the same run with --prefill-schedule layered: prompts over --max-batched-tokens go through "
        "layer groups instead of token chunks; needs --max-batched-tokens; MoE models report expert "
        "weight reads of both)",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=positive_int,
        default=None,
        help="the step's token budget: prompts over it are cut (--prefill-schedule) (default: none, every "
        "prompt of the batch in one step)",
    )
    p.add_argument(
        "--peer-timeout", type=float, default=1800.0, help="seconds each peer may take (default %(default)s)"
    )


def _add_analysis_flags(p: argparse.ArgumentParser) -> None:
    """Where the time goes: the communication overlap hides, and the profiler's breakdown."""
    p.add_argument(
        "--overlap-report",
        action="store_true",
        help="run the workload three ways (tensor parallel baseline, token-split overlap, collectives "
        "skipped = wrong output, the lower bound) and report the fraction of communication hidden",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after the timed runs, run the workload once more under the torch profiler and write each "
        "rank's op table (DIR/rank<N>.txt) and where one decode step's time goes (GEMM, attention, "
        "communication, other ops, Python) into the JSON as 'profile'",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """The results besides the table: a JSON line, a bar chart."""
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line (rank 0)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a bar chart of throughput per system")


def _add_sweep_flags(p: argparse.ArgumentParser) -> None:
    """--sweep: every layout that fits, measured against the planner's predictions."""
    p.add_argument(
        "--sweep",
        default=None,
        metavar='"tp=1,2 pp=1,2 cp=1,2"',
        help="run every combination of these sizes that fits this machine (one bench run each, this "
        "command's other flags for all) and print measured against predicted TTFT and TPOT, parallel "
        "efficiency, --json and --plot",
    )
    p.add_argument(
        "--hardware-profile",
        default=None,
        metavar="FILE",
        help="--sweep: the profile from `dist-infer calibrate` the predictions use (default: calibrate "
        "now with --quick)",
    )
    p.add_argument(
        "--sweep-max-ranks",
        type=int,
        default=None,
        help="--sweep: skip layouts of more ranks than this (default: twice the usable cores)",
    )
    p.add_argument(
        "--sweep-rounds",
        type=int,
        default=1,
        help="--sweep: run the whole list of layouts this many times, one launch of each layout per round, "
        "and compare each layout's median TTFT and median decode step over the rounds. On a shared "
        "machine whose speed drifts over minutes, rounds spread every layout over the same stretch of "
        "time, and each launch draws its own placement of ranks on cores and its own spell of the machine "
        "(docs/benchmarks.md, 'Choosing the layout') (default %(default)s)",
    )
    p.add_argument(
        "--sweep-speed-check",
        choices=("on", "off"),
        default="off",
        help="--sweep: on: before each layout, time the machine's GEMM and weight-streaming speed (about "
        "2 s), predict for the machine as fast as it is then (against the profile's own reference "
        "timing) and print that speed; off: predict with the profile as it is. Off by default: one "
        "2 s sample is noisier than the drift it corrects (docs/benchmarks.md, 'Choosing the layout'). Needs a "
        "profile from calibrate, which records the reference (default: %(default)s)",
    )


def _add_routing_flags(p: argparse.ArgumentParser) -> None:
    """MoE models: the routing measured in the run, kept for a balanced expert placement."""
    p.add_argument(
        "--save-routing",
        default=None,
        metavar="FILE",
        help="MoE models: write the measured tokens per expert (per layer) and a balanced expert placement "
        "for this ep to FILE, for --expert-placement",
    )


def parse_compare(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in COMPARABLE]
    if bad:
        raise SystemExit(f"dist-infer bench: unknown --compare peer(s) {bad}; choose from {', '.join(COMPARABLE)}")
    return names

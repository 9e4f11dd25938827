"""The `dist-infer` argument parser: one subcommand per command, and the flags the rank commands
share (the parallel layout, how a rank communicates, compute/communication overlap).

Importing it loads no torch: the flags of generate, bench, serve, plan and bench-serve come from
modules that import their heavy dependencies only when their command runs.
"""

from __future__ import annotations

import argparse

from dist_infer import __version__
from dist_infer.arg_types import port_number, positive_int, positive_int_or_auto, size_list
from dist_infer.comm.backends import BACKENDS, DEFAULT_TIMEOUT_S


def add_rank_flags(p: argparse.ArgumentParser) -> None:
    """Flags of every command that runs as one rank of a job."""
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="communication backend: auto (NCCL for CUDA tensors when a GPU is present, gloo for CPU), "
        "nccl, gloo, or mpi (mpi4py; no torch.distributed)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds any distributed wait may take before the job is ended (default %(default)s)",
    )
    p.add_argument(
        "--iface",
        default=None,
        help="network interface for gloo/NCCL sockets on multi-host jobs (default: the one that reaches the master address)",
    )
    p.add_argument(
        "--shm",
        choices=("auto", "off", "socket"),
        default="auto",
        help="how a tensor- or context-parallel group's small CPU collectives (two all-reduces a layer) "
        "travel: auto (default) through shared memory when the group is on one node, over the "
        "group's own TCP links when it spans nodes; socket: those TCP links in every case; off: "
        "always the backend's own collectives (gloo)",
    )
    p.add_argument("--log-level", default="INFO", help="loguru level: DEBUG, INFO, WARNING (default %(default)s)")


def add_parallel_flags(p: argparse.ArgumentParser, cp_auto: bool = False) -> None:
    """tp, pp, ep, cp; `cp_auto`: --cp also takes auto (commands that know their prompts up front)."""
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (ranks sharing each layer)")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size (stages of layers)")
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel size (ranks sharing the experts)")
    if cp_auto:
        p.add_argument(
            "--cp",
            type=positive_int_or_auto,
            default=1,
            help="context-parallel size (ranks sharing the sequence), or auto: from the longest prompt, "
            "at least 4096 tokens per cp rank, within --nproc (else the cores or GPUs) after tp x pp "
            "x ep; under torchrun/mpirun/srun, the job's ranks after tp x pp x ep",
        )
    else:
        p.add_argument("--cp", type=positive_int, default=1, help="context-parallel size (ranks sharing the sequence)")


def add_overlap_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overlap",
        choices=("on", "off", "auto"),
        default="auto",
        help="token-splitting compute/communication overlap in tensor-parallel layers: split every step "
        "(on), never (off), or steps of at least --overlap-threshold tokens (auto, default)",
    )
    p.add_argument(
        "--overlap-threshold",
        type=int,
        default=None,
        help="tokens per step from which --overlap auto splits (default per device kind: 1024 on CUDA, "
        "TokenWeave's figure; never on CPU, where splitting was measured slower; see "
        "docs/benchmarks.md, 'Token-splitting overlap')",
    )
    p.add_argument(
        "--sequence-parallel",
        choices=("on", "off", "auto"),
        default="auto",
        help="tensor-parallel layers with the all-reduce split into reduce-scatter and all-gather, the "
        "residual and RMSNorm on 1/tp of the tokens each: on every step that is not token-split (on), "
        "never (off), or steps of at least --sequence-parallel-threshold tokens (auto, default)",
    )
    p.add_argument(
        "--sequence-parallel-threshold",
        type=int,
        default=None,
        help="tokens per step from which --sequence-parallel auto applies (default: none, so auto leaves it "
        "off: on CPU it was measured slower than plain tp, on CUDA it is not measured yet; "
        "see docs/benchmarks.md, 'Token-splitting overlap')",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dist-infer",
        description="Distributed LLM inference: tensor, pipeline, expert and context parallelism.",
    )
    parser.add_argument("--version", action="version", version=f"dist-infer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (
        _add_launch,
        _add_comm_test,
        _add_generate,
        _add_bench,
        _add_plan,
        _add_calibrate,
        _add_serve,
        _add_bench_serve,
    ):
        add(sub)
    return parser


def _add_launch(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="start the ranks of a job (locally, per node, or on every host of a hostfile)",
        description="Start COMMAND as the ranks of a job. If any rank fails, the others are stopped and "
        "the launcher exits non-zero naming it.",
        epilog="examples:\n"
        "  dist-infer launch --nproc-per-node 4 -- dist-infer comm-test --tp 2 --pp 2\n"
        "  dist-infer launch --hostfile hosts --node-rank 1 -- dist-infer comm-test   (on node 1)\n"
        "  dist-infer launch --hostfile hosts -- dist-infer comm-test                 (ssh to every host)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc-per-node",
        type=positive_int,
        default=1,
        help="ranks to start on this node when there is no hostfile (default %(default)s)",
    )
    p.add_argument("--hostfile", help="hosts and their slots ('host slots=N', 'host:N' or 'host' per line)")
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="with --hostfile: start only this node's ranks (run once on every node, no ssh needed)",
    )
    p.add_argument("--master-addr", help="address of rank 0's host (default: the first host, or 127.0.0.1)")
    p.add_argument(
        "--master-port", type=port_number, help="rendezvous port (default: 29500 with a hostfile, a free port locally)"
    )
    p.add_argument(
        "--launcher",
        choices=("local", "torchrun", "mpirun"),
        default="local",
        help="who starts the ranks: this process (local), torchrun, or mpirun (default %(default)s)",
    )
    p.add_argument(
        "--ssh-command",
        default="ssh",
        help="command that runs a shell line on a host, given 'HOST LINE' (default %(default)s)",
    )
    p.add_argument("--iface", help="network interface for gloo/NCCL sockets (default: the one that reaches the master)")
    p.add_argument("--dry-run", action="store_true", help="print the commands that would run, run nothing")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...: what every rank runs")


def _add_comm_test(sub) -> None:
    p = sub.add_parser(
        "comm-test",
        help="check and time every collective and point-to-point op on every parallel group",
        description="Run under any launcher (torchrun, mpirun, srun, dist-infer launch). Builds the mesh, runs every "
        "op on every group at several sizes, checks each result against independently computed values, "
        "and prints latency and bus bandwidth (nccl-tests convention) on rank 0. Exit 0 only if all passed.",
    )
    add_parallel_flags(p)
    add_rank_flags(p)
    p.add_argument("--sizes", type=size_list, default=None, help="message sizes, e.g. 4K,256K,4M (default 4K,256K,4M)")
    p.add_argument(
        "--iters", type=positive_int, default=None, help="timed iterations per case (default: by size, 5..50)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line (rank 0)")


def _add_generate(sub) -> None:
    from dist_infer.cli.generate_cmd import add_generate_flags

    p = sub.add_parser(
        "generate",
        help="generate text with a model sharded over the job (tensor and pipeline parallel)",
        description="Load a HF Llama-family checkpoint (or the built-in default) with tp x pp ranks and generate "
        "for a batch of prompts. With --nproc N (or by default tp x pp) it starts the local ranks itself; "
        "under torchrun, mpirun or dist-infer launch it runs as one rank.",
    )
    add_parallel_flags(p, cp_auto=True)
    add_rank_flags(p)
    add_generate_flags(p)
    add_overlap_flags(p)


def _add_bench(sub) -> None:
    from dist_infer.bench import add_bench_flags
    from dist_infer.launch.model_options import add_model_flags, add_prefill_schedule_flags
    from dist_infer.launch.speculative_flags import add_speculative_flags

    p = sub.add_parser(
        "bench",
        help="measure prefill/decode throughput, side by side with DeepSpeed AutoTP and HF transformers",
        description="Run a fixed workload (batch x prompt-len random prompts, gen-len greedy tokens) through this "
        "engine, then through each --compare peer in the same invocation, and report ratios.",
    )
    add_parallel_flags(p, cp_auto=True)
    add_rank_flags(p)
    add_model_flags(p)  # the same model and layout flags as generate and serve
    add_bench_flags(p)
    add_prefill_schedule_flags(p)
    add_speculative_flags(p)
    add_overlap_flags(p)


def _add_plan(sub) -> None:
    from dist_infer.planner.plan import add_plan_flags

    p = sub.add_parser(
        "plan",
        help="pick the layout (tp / pp / cp / ep) for a model, GPUs and workload from a cost model, with the "
        "predicted TTFT, TPOT and memory per rank",
        description="Predict every layout of --gpus ranks the engine can run for --model with a cost model of its "
        "own schedules (GEMM and attention FLOPs per rank, the collectives each layout issues and how much "
        "overlap hides, pipeline bubbles, weights / KV / activation memory per rank) on a hardware profile "
        "(published figures for GPUs we cannot reach, or `dist-infer calibrate` for this machine), and "
        "rank the ones that fit in memory. Exit 1 when none fits, 2 on bad input.",
    )
    add_plan_flags(p)


def _add_calibrate(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine (GEMM, attention, memory bandwidth, collectives, fixed costs) into a hardware "
        "profile for plan and bench --sweep",
        description="Measure GEMM and attention throughput per thread count, streaming memory bandwidth, every "
        "collective's latency and bus bandwidth (comm-test, per backend and group size) and the engine's "
        "fixed costs per layer and per step, alone and in every layout of 2 (and twice the cores) ranks, "
        "and write them as a hardware profile JSON.",
    )
    p.add_argument("--out", default="dist-infer-profile.json", help="profile file to write (default %(default)s)")
    p.add_argument(
        "--reference",
        action="store_true",
        help="only print the machine's speed now as JSON (a prefill's GEMM rate and the weight-streaming "
        "rate, about a second; what bench --sweep compares with the profile's before each layout), "
        "and write no profile",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer sizes, only 2-rank collectives and only the 2-rank layouts' fixed costs (several "
        "times shorter than the full run)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each measuring job may take")
    p.add_argument("--json", action="store_true", help="also print the profile as one JSON line")


def _add_serve(sub) -> None:
    from dist_infer.cli.serve_flags import add_serve_flags

    p = sub.add_parser(
        "serve",
        help="serve the model over the job's ranks behind an OpenAI-compatible HTTP API",
        description="Load a checkpoint with tp x pp (x ep x cp) ranks and serve it: continuous batching with "
        "chunked prefill, /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics. "
        "The API is a process of its own that runs no model: run directly, it starts each instance "
        "(--instances) as a job of its own on this host; under torchrun, mpirun or dist-infer launch "
        "the job's ranks are the instances and world rank 0 starts the API beside them.",
        epilog="example:\n  dist-infer serve --tp 2 --port 8000 --api-key $KEY &\n"
        '  curl http://127.0.0.1:8000/v1/completions -H "Authorization: Bearer $KEY" \\\n'
        '       -H \'content-type: application/json\' -d \'{"prompt": "Hello", "max_tokens": 8}\'',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_parallel_flags(p)
    add_rank_flags(p)
    add_serve_flags(p)
    add_overlap_flags(p)


def _add_bench_serve(sub) -> None:
    from dist_infer.bench.serve.flags import add_bench_serve_flags  # argparse only: no numpy, no httpx

    p = sub.add_parser(
        "bench-serve",
        help="load-test any OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput, goodput",
        description="Send a stream of requests (Poisson or gamma arrivals, synthetic lengths, a ShareGPT file or a "
        "timestamped trace) to an OpenAI-compatible server and report latency percentiles and throughput.",
    )
    add_bench_serve_flags(p)

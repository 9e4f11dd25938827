"""`dist-infer bench`: our engine on every rank, then each peer in its own processes, one table.

How a rank joins the job, loads its shard and builds the engine is the rank start-up's
(`dist_infer.launch`, above this layer): the CLI hands it down as a `RankStart`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from loguru import logger

from dist_infer.bench.flags import parse_compare
from dist_infer.bench.memory import generation_memory
from dist_infer.bench.overlap import MEASURED_GROUPS, P2P_RUNS, TP_RUNS, format_overlap, overlap_report
from dist_infer.bench.report import plot, ratio, run_ours_single_process, run_ours_variant, save_routing
from dist_infer.bench.timing import measure


@dataclass(frozen=True)
class RankStart:
    """This rank's start, as the command's flags say: `join()` joins the job -> its parallel groups;
    `load(groups)` -> (this rank's stage of the model, its load report, the model path);
    `build_engine(stage, groups)` -> our engine over the stage."""

    join: Callable[[], Any]
    load: Callable[[Any], tuple[Any, Any, str]]
    build_engine: Callable[[Any, Any], Any]


def run_bench(args, start: RankStart) -> int:
    peers = parse_compare(args.compare)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("dist-infer bench: --plot needs matplotlib: pip install 'dist_infer[plot]'")
    measured = _run_ours(args, peers, start)
    if measured is None:  # every rank but 0 is done once ours has run
        return 0
    ours, model, bar = measured
    compare = _run_peers(args, peers, ours, model, bar)
    _print_report(args, model, ours, compare)
    return 0


def _run_ours(args, peers: list[str], start: RankStart):
    """Our engine on every rank (timed runs, generation memory, and --profile / --overlap-report).
    -> rank 0: (our metrics, the model path, the progress bar, still open for the peers); None elsewhere."""
    import torch
    from tqdm import tqdm

    from dist_infer.bench.peers import make_prompts
    from dist_infer.comm.measured import MeasuredCommunicator
    from dist_infer.models.moe import moe_report

    groups = start.join()
    world = groups.world
    plain_groups = groups  # what to tear down at the end (the wrappers below share their communicators)
    if args.overlap_report or args.profile:  # time (and for the report, serialise or skip) each group's communication
        groups = dataclasses.replace(groups, **{g: MeasuredCommunicator(getattr(groups, g)) for g in MEASURED_GROUPS})
    stage, report, model = start.load(groups)
    engine = start.build_engine(stage, groups)
    prompts = make_prompts(args.batch, args.prompt_len, stage.cfg.vocab_size).tolist()
    measured_runs = 0
    if args.overlap_report:
        measured_runs = (len(TP_RUNS) if groups.tp.size > 1 else 0) + sum(
            len(plan) for g, plan in P2P_RUNS.items() if getattr(groups, g).size > 1
        )
    bar = tqdm(
        total=args.repeat * (1 + measured_runs) + len(peers),
        desc="bench",
        unit="run",
        file=sys.stderr,
        disable=None if world.rank == 0 else True,
    )
    timing, gen_peak, gen_above = generation_memory(
        lambda: measure(engine, prompts, args.gen_len, args.repeat, lambda: bar.update(1))
    )
    gen_mem = torch.zeros(3, world.size, dtype=torch.float64)
    gen_mem[:, world.rank] = torch.tensor([gen_peak or float("nan"), gen_above or float("nan"), timing["ttft_cpu_s"]])
    world.all_reduce(gen_mem)
    moe = moe_report(stage, groups)
    profile = None
    if args.profile:
        from dist_infer.bench.profile import profile_generation

        profile = profile_generation(engine, prompts, args.gen_len, args.profile, world.rank)
    overlap = overlap_report(engine, groups, prompts, args, lambda: bar.update(1)) if args.overlap_report else None
    peaks = torch.zeros(world.size, dtype=torch.float64)
    peaks[world.rank] = report.peak_rss_mb
    world.all_reduce(peaks)
    world.barrier()
    ladder_layers = engine.cfg.ladder_layers  # (first, last) this rank's model runs as a ladder, or None
    speculative = engine.speculative.snapshot() if engine.config.speculative is not None else None
    engine.close()
    plain_groups.destroy()
    world.destroy()
    if world.rank != 0:
        return None
    ours = {
        "peer": "dist-infer",
        **timing,
        "peak_rss_mb": float(peaks.max()),
        "peak_rss_mb_per_rank": peaks.tolist(),
        "load_s": report.load_s,
        "tp": args.tp,
        "pp": args.pp,
        "world_size": world.size,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "cp": args.cp,
        "cp_variant": args.cp_variant,
        "prefill_s": timing["ttft_s"],
        "gen_peak_rss_mb_per_rank": gen_mem[0].tolist(),
        "kv_act_peak_mb_per_rank": gen_mem[1].tolist(),
        "prefill_cpu_s_per_rank": gen_mem[2].tolist(),
        "ep": args.ep,
        "threads_total": _threads_total(world.size),
        "ladder_layers": ladder_layers,
        "prefill_schedule": getattr(args, "prefill_schedule", "chunked"),
        "max_batched_tokens": args.max_batched_tokens,
        **({"moe": moe} if moe is not None else {}),
        **({"speculative": speculative} if speculative is not None else {}),
        **({"profile": profile} if profile is not None else {}),
        **({"overlap": overlap} if overlap else {}),
    }
    return ours, model, bar


def _threads_total(world_size: int) -> int:
    """The cores our run used, as far as this host goes: ranks x this rank's threads, at most its cores."""
    import torch

    from dist_infer.topology.cores import usable_cores

    return min(usable_cores(), world_size * torch.get_num_threads())


def _hf_placement(args) -> dict:
    """transformers runs where and in the dtype ours ran: one GPU under --device cuda (else the CPU)."""
    from dist_infer.models.loader import resolve_device

    return {"device": resolve_device(getattr(args, "device", "auto")).type, "dtype": getattr(args, "dtype", "float32")}


def _run_peers(args, peers: list[str], ours: dict, model: str, bar) -> dict:
    """Rank 0: each --compare peer in its own processes, one after another -> {peer: metrics}."""
    from dist_infer.bench.peers import run_peer

    compare = {}
    nproc_peer = ours["world_size"]
    for peer in peers:
        bar.set_postfix_str(peer)
        if peer == "ours-1proc":
            metrics = run_ours_single_process(args)
        elif peer in ("ladder", "layered"):
            metrics = run_ours_variant(args, peer)
        else:
            threads = ours["threads_total"] if peer == "llama.cpp" else None  # one process: all our ranks' cores
            where = _hf_placement(args) if peer in ("hf", "hf-compiled") else {}
            metrics = run_peer(
                peer,
                model,
                nproc_peer,
                args.batch,
                args.prompt_len,
                args.gen_len,
                args.peer_timeout,
                threads=threads,
                repeats=args.repeat,
                **where,
            )
        metrics.pop("token_ids", None)
        metrics["prefill_ratio"] = ratio(ours["prefill_tok_s"], metrics.get("prefill_tok_s"))
        metrics["decode_ratio"] = ratio(ours["decode_tok_s"], metrics.get("decode_tok_s"))
        if not metrics.get("ok"):
            logger.warning(f"peer {peer} failed: {str(metrics.get('error'))[:500]}")
        compare[peer] = metrics
        bar.update(1)
    bar.close()
    return compare


def _print_report(args, model: str, ours: dict, compare: dict) -> None:
    """Rank 0: the table, our memory and prefill lines, the extras asked for, --plot and --json."""
    print(
        f"bench: {os.path.basename(model.rstrip('/'))}, batch {args.batch} x prompt {args.prompt_len}, "
        f"{args.gen_len} new tokens, tp={args.tp} pp={args.pp} cp={args.cp} ep={args.ep} on {ours['world_size']} rank(s)"
    )
    print(
        f"{'system':<14}{'prefill tok/s':>15}{'decode tok/s':>14}{'ttft ms':>10}{'tpot ms':>10}"
        f"{'prefill x':>11}{'decode x':>10}"
    )
    rows = [("dist-infer", ours)] + [(k, v) for k, v in compare.items()]
    for name, m in rows:

        def fmt(v, scale=1.0, spec=".1f"):
            return format(v * scale, spec) if isinstance(v, (int, float)) and v else "-"

        print(
            f"{name:<14}{fmt(m.get('prefill_tok_s')):>15}{fmt(m.get('decode_tok_s')):>14}"
            f"{fmt(m.get('ttft_s'), 1e3):>10}{fmt(m.get('tpot_s'), 1e3):>10}"
            f"{fmt(m.get('prefill_ratio'), 1, '.2f'):>11}{fmt(m.get('decode_ratio'), 1, '.2f'):>10}"
        )
    print("(x = dist-infer's throughput divided by the system's, same run)")
    for name, m in compare.items():
        if m.get("ok") and m.get("note"):
            print(f"{name}: {m['note']}")
        if m.get("ok") and m.get("moe") and ours.get("moe"):
            mine, theirs = ours["moe"]["expert_bytes"]["prompt"], m["moe"]["expert_bytes"]["prompt"]
            print(
                f"{name}: expert weights read in steps with prompt tokens {theirs / 2**20:.0f} MiB, ours "
                f"{mine / 2**20:.0f} MiB ({ratio(theirs, mine) or 0:.2f}x ours)"
            )
    print(
        f"prefill: {ours['ttft_s']:.3f} s for {args.batch} x {args.prompt_len} tokens (cp={args.cp}); "
        f"peak memory above the loaded model (KV cache + activations) per rank: "
        f"{', '.join(f'{m:.0f}' for m in ours['kv_act_peak_mb_per_rank'])} MiB "
        f"(peak RSS {', '.join(f'{m:.0f}' for m in ours['gen_peak_rss_mb_per_rank'])} MiB); prefill CPU time per rank "
        f"{', '.join(f'{c:.2f}' for c in ours['prefill_cpu_s_per_rank'])} s"
    )
    moe, profile, speculative = ours.get("moe"), ours.get("profile"), ours.get("speculative")
    if speculative is not None:
        print(
            f"speculative: {speculative['num_accepted_tokens']} of {speculative['num_draft_tokens']} proposed tokens "
            f"accepted in {speculative['num_drafts']} rounds (all timed runs)"
        )
    if moe is not None:
        from dist_infer.models.moe import format_routing_report

        print(format_routing_report(moe))
    if profile is not None:
        from dist_infer.bench.profile import format_profile

        print(format_profile(profile))
    if args.save_routing:
        save_routing(args.save_routing, moe, args.ep)
    if ours.get("overlap"):
        print(format_overlap(ours["overlap"]))
    if args.plot:
        plot(args.plot, [(n, m) for n, m in rows if m.get("ok", True)])
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps({**ours, "compare": compare}))

"""`dist-infer bench`: prefill and decode throughput, side by side with the peers in the same run.

Our engine runs the workload first (all ranks), then rank 0 runs each peer named by --compare
in its own processes, one after another so they never share the cores, and reports our numbers
as ratios to theirs. Every system gets the same prompts (seeded B x P random ids) and the same
greedy loop shape: one prefill, then G-1 decode steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from typing import Optional

from loguru import logger

from dist_infer.topology.discovery import without_launcher_env

COMPARABLE = ("deepspeed", "hf", "hf-tp", "ours-1proc")
MEASURED_GROUPS = ("tp", "pp", "cp")  # the groups whose communication --overlap-report measures


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    from dist_infer.launch.model_options import add_model_flags

    add_model_flags(p)  # the same model and layout flags as generate and serve
    p.add_argument("--batch", type=int, default=4, help="prompts per batch (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default %(default)s)")
    p.add_argument("--gen-len", type=int, default=32, help="new tokens per prompt (default %(default)s)")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed runs of our engine; the best is reported (default %(default)s)")
    p.add_argument("--compare", default="",
                   help="peers to run in the same invocation, comma separated: deepspeed (AutoTP, tp ranks), "
                        "hf (transformers, one process), hf-tp (transformers tp_plan=auto, tp ranks), "
                        "ours-1proc (this engine in one process on all cores)")
    p.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds each peer may take (default %(default)s)")
    p.add_argument("--overlap-report", action="store_true",
                   help="run the workload three ways (tensor parallel baseline, token-split overlap, collectives "
                        "skipped = wrong output, the lower bound) and report the fraction of communication hidden")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed runs, run the workload once more under the torch profiler and write each "
                        "rank's op table (DIR/rank<N>.txt) and where one decode step's time goes (GEMM, attention, "
                        "communication, other ops, Python) into the JSON as 'profile'")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line (rank 0)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a bar chart of throughput per system")
    p.add_argument("--save-routing", default=None, metavar="FILE",
                   help="MoE models: write the measured tokens per expert (per layer) and a balanced expert placement "
                        "for this ep to FILE, for --expert-placement")


def parse_compare(text: str) -> list[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in COMPARABLE]
    if bad:
        raise SystemExit(f"dist-infer bench: unknown --compare peer(s) {bad}; choose from {', '.join(COMPARABLE)}")
    return names


def _ratio(ours: Optional[float], theirs: Optional[float]) -> Optional[float]:
    return ours / theirs if ours and theirs else None


def run_ours_single_process(args) -> dict:
    """This engine at tp=1 in one process using every core, for the 'same 2 cores' comparison."""
    cmd = [sys.executable, "-m", "dist_infer", "bench", "--nproc", "1", "--batch", str(args.batch),
           "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len), "--repeat", str(args.repeat), "--json"]
    if args.model:
        cmd += ["--model", args.model]
    env = without_launcher_env(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # one process on every core
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.peer_timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"peer": "ours-1proc", "ok": False, "error": (proc.stderr or proc.stdout)[-2000:]}
    out = json.loads(lines[-1])
    out.update(peer="ours-1proc", ok=True, tp=1)
    out.pop("compare", None)
    return out


def reset_peak_rss() -> bool:
    """Restart this process's peak-RSS counter (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset_mb() -> float:
    """VmHWM in MiB: the peak resident memory since the last `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise OSError("no VmHWM in /proc/self/status")


def generation_memory(run) -> tuple[object, Optional[float], Optional[float]]:
    """Run `run()` and measure this rank's memory: (its result, peak RSS during it, peak above the RSS before it).

    The second number is what generation itself holds at its peak: KV cache plus activations
    (plus ring buffers with cp), the loaded weights excluded. None where /proc cannot tell.
    """
    from dist_infer.models.checkpoint import current_rss_mb

    before = current_rss_mb()
    if not reset_peak_rss():
        return run(), None, None
    result = run()
    peak = peak_rss_since_reset_mb()
    return result, peak, max(0.0, peak - before)


def measure(engine, prompts, gen_len: int, repeat: int, progress, comms: Optional[dict] = None) -> dict:
    """The best of `repeat` timed runs; with `comms` (axis -> MeasuredCommunicator), also the seconds
    each group's communication kept this rank waiting in that run ("exposed_s": axis -> op -> s)."""
    comms = comms or {}
    from dist_infer.engine.sampling import SamplingParams

    engine.generate([p[:16] for p in prompts], SamplingParams(max_new_tokens=3, stop_at_eos=False))  # warm-up
    if hasattr(engine.stage, "reset_routing_stats"):
        engine.stage.reset_routing_stats()  # MoE routing statistics of the timed runs only
    best = None
    for _ in range(repeat):
        for c in comms.values():
            c.reset()
        engine.generate(prompts, SamplingParams(max_new_tokens=gen_len, stop_at_eos=False))
        t = engine.timing.as_dict()
        if comms:
            t["exposed_s"] = {axis: c.reset() for axis, c in comms.items() if c.size > 1}
        if best is None or t["ttft_s"] + t["tpot_s"] * gen_len < best["ttft_s"] + best["tpot_s"] * gen_len:
            best = t
        progress()
    return best


def hidden_fraction(t_base: float, t_overlap: float, t_nocomm: float) -> float:
    """Share of the exposed communication time that overlap removed: (base - overlap) / (base - nocomm)."""
    exposed = t_base - t_nocomm
    return (t_base - t_overlap) / exposed if exposed > 0 else 0.0


def report_runs(runs: dict) -> dict:
    """t_base/t_overlap/t_nocomm, the hidden fraction and the exposed time (t_overlap - t_nocomm:
    what the communication still costs), for prefill (ttft) and per decode step, plus the
    seconds each run spent waiting inside communication calls. No "base" run: t_base_s and
    hidden_fraction are None."""
    def phase(key: str) -> dict:
        t = {f"t_{n}_s": runs[n][key] if n in runs else None for n in ("base", "overlap", "nocomm")}
        hidden = None if t["t_base_s"] is None else hidden_fraction(t["t_base_s"], t["t_overlap_s"], t["t_nocomm_s"])
        extra = {"t_sequence_parallel_s": runs["sequence_parallel"][key]} if "sequence_parallel" in runs else {}
        return {**t, "hidden_fraction": hidden, "exposed_s": max(0.0, t["t_overlap_s"] - t["t_nocomm_s"]), **extra}

    return {**phase("ttft_s"), "decode": phase("tpot_s"), "waiting_s": {n: r.get("exposed_s", {}) for n, r in runs.items()}}


# The runs per group: (name in the report, token split for tp, communicator mode).
# tp: plain tensor parallel, token split, collectives skipped, and the sequence-parallel variant
# (reduce-scatter + all-gather around the norms), all with the same workload.
TP_RUNS = (("base", "off", "off", "overlap"), ("overlap", "on", "off", "overlap"), ("nocomm", "off", "off", "skip"),
           ("sequence_parallel", "off", "on", "overlap"))
# Ring transfers are posted in send/receive pairs, so waiting for each at once is a valid
# no-overlap baseline. Pipeline sends are not: a stage blocking in send until the next stage
# receives deadlocks the microbatch schedule, so pp reports the exposed time without a base.
P2P_RUNS = {"cp": (("base", "serial"), ("overlap", "overlap"), ("nocomm", "skip")),
            "pp": (("overlap", "overlap"), ("nocomm", "skip"))}


def overlap_runs(engine, groups, prompts, args, progress) -> dict:
    """The runs per measured group: how much of each kind of communication is hidden.

    tp: base = no token splitting, overlap = the token-split schedule, nocomm = collectives
    skipped, and the sequence-parallel variant alongside. cp (ring-attention transfers) and pp (pipeline stage sends), overlapped by design:
    base = every transfer waited for as soon as it is posted (cp only), overlap = the normal
    schedule, nocomm = the transfers' payloads skipped."""
    comms = {g: getattr(groups, g) for g in MEASURED_GROUPS}
    out = {}
    if groups.tp.size > 1:
        runs = {}
        for name, split, sp, mode in TP_RUNS:
            engine.overlap, engine.sequence_parallel = split, sp
            groups.tp.set_mode(mode)
            runs[name] = measure(engine, prompts, args.gen_len, args.repeat, progress, comms)
        engine.overlap, engine.sequence_parallel = args.overlap, args.sequence_parallel
        groups.tp.set_mode("overlap")
        out["tp"] = report_runs(runs)
    for g, plan in P2P_RUNS.items():
        comm = getattr(groups, g)
        if comm.size == 1:
            continue
        runs = {}
        for name, mode in plan:
            comm.set_mode(mode)
            runs[name] = measure(engine, prompts, args.gen_len, args.repeat, progress, comms)
        comm.set_mode("overlap")
        out[g] = report_runs(runs)
    return out


def overlap_report(engine, groups, prompts, args, progress) -> dict:
    """`{"overlap": ...}` of the JSON: the tp numbers at the top level (the issue's keys), the
    pipeline and ring transfers under "pp" and "cp"."""
    runs = overlap_runs(engine, groups, prompts, args, progress)
    tp = runs.pop("tp", None)
    return {**(tp or {}), **runs, "tokens_per_prefill": sum(len(p) for p in prompts)}


def format_overlap(overlap: dict) -> str:
    def ms(v) -> str:
        return "-" if v is None else f"{v * 1e3:.1f} ms"

    lines = []
    sections = [("tp collectives (token split)", overlap if "t_overlap_s" in overlap else None),
                ("pp stage transfers", overlap.get("pp")), ("cp ring transfers", overlap.get("cp"))]
    for title, o in sections:
        if not o:
            continue
        for phase, label in (("prefill", "prefill (ttft)"), ("decode", "decode (per step)")):
            p = o["decode"] if phase == "decode" else o
            hidden = "" if p["hidden_fraction"] is None else f", hidden fraction {p['hidden_fraction']:.2f}"
            sp = f"; sequence parallel {ms(p['t_sequence_parallel_s'])}" if "t_sequence_parallel_s" in p else ""
            lines.append(f"overlap, {title}, {label}: base {ms(p['t_base_s'])}, overlapped {ms(p['t_overlap_s'])}, "
                         f"no communication {ms(p['t_nocomm_s'])} -> exposed {ms(p['exposed_s'])}{hidden}{sp}")
        waits = o.get("waiting_s", {}).get("overlap", {})
        waits = ", ".join(f"{g} {sum(ops.values()) * 1e3:.1f} ms" for g, ops in waits.items() if ops)
        if waits:
            lines.append(f"  time inside communication calls in the overlapped run (whole generation): {waits}")
    return "\n".join(lines)


def plot(path: str, rows: list[tuple[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _ in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill tokens/s"), (axes[1], "decode_tok_s", "decode tokens/s")):
        values = [m.get(key) or 0.0 for _, m in rows]
        bars = ax.bar(names, values, color=["tab:green"] + ["tab:gray"] * (len(rows) - 1))
        ax.bar_label(bars, fmt="%.0f")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("dist-infer bench (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_routing(path: str, moe: Optional[dict], ep: int) -> None:
    """The measured tokens per expert and a balanced placement for `ep`, for --expert-placement."""
    from dist_infer.parallel.moe.routing_file import write_routing_file

    if moe is None:
        raise SystemExit("dist-infer bench: --save-routing needs a mixture-of-experts model")
    write_routing_file(path, {i: layer["tokens_per_expert"] for i, layer in moe["layers"].items()}, ep)
    print(f"routing counts and a balanced placement for ep={ep} written to {path}")


def run_bench(args) -> int:
    import torch
    from tqdm import tqdm

    from dist_infer.comm.measured import MeasuredCommunicator
    from dist_infer.launch.generate_cmd import moe_report
    from dist_infer.launch.model_options import build_engine, load_model
    from dist_infer.launch.peers import make_prompts, run_peer
    from dist_infer.launch.rank import join_job
    from dist_infer.topology import ParallelConfig

    peers = parse_compare(args.compare)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("dist-infer bench: --plot needs matplotlib: pip install 'dist_infer[plot]'")
    groups = join_job(args.backend, ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp),
                      args.timeout, args.iface, args.log_level, args.shm)
    world = groups.world
    plain_groups = groups  # what to tear down at the end (the wrappers below share their communicators)
    if args.overlap_report or args.profile:  # time (and for the report, serialise or skip) each group's communication
        groups = dataclasses.replace(groups, **{g: MeasuredCommunicator(getattr(groups, g)) for g in MEASURED_GROUPS})
    stage, report, model = load_model(args, groups)
    engine = build_engine(args, stage, groups)
    prompts = make_prompts(args.batch, args.prompt_len, stage.cfg.vocab_size).tolist()
    measured_runs = 0
    if args.overlap_report:
        measured_runs = (len(TP_RUNS) if groups.tp.size > 1 else 0) + sum(
            len(plan) for g, plan in P2P_RUNS.items() if getattr(groups, g).size > 1)
    bar = tqdm(total=args.repeat * (1 + measured_runs) + len(peers), desc="bench", unit="run", file=sys.stderr,
               disable=None if world.rank == 0 else True)
    timing, gen_peak, gen_above = generation_memory(
        lambda: measure(engine, prompts, args.gen_len, args.repeat, lambda: bar.update(1)))
    gen_mem = torch.zeros(3, world.size, dtype=torch.float64)
    gen_mem[:, world.rank] = torch.tensor([gen_peak or float("nan"), gen_above or float("nan"), timing["ttft_cpu_s"]])
    world.all_reduce(gen_mem)
    moe = moe_report(stage, groups)
    profile = None
    if args.profile:
        from dist_infer.launch.profile import profile_generation

        profile = profile_generation(engine, prompts, args.gen_len, args.profile, world.rank)
    overlap = overlap_report(engine, groups, prompts, args, lambda: bar.update(1)) if args.overlap_report else None
    peaks = torch.zeros(world.size, dtype=torch.float64)
    peaks[world.rank] = report.peak_rss_mb
    world.all_reduce(peaks)
    world.barrier()
    engine.close()
    plain_groups.destroy()
    world.destroy()
    if world.rank != 0:
        return 0
    ours = {"peer": "dist-infer", **timing, "peak_rss_mb": float(peaks.max()), "peak_rss_mb_per_rank": peaks.tolist(),
            "load_s": report.load_s, "tp": args.tp, "pp": args.pp, "world_size": world.size,
            "batch": args.batch, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "cp": args.cp, "cp_variant": args.cp_variant, "prefill_s": timing["ttft_s"],
            "gen_peak_rss_mb_per_rank": gen_mem[0].tolist(), "kv_act_peak_mb_per_rank": gen_mem[1].tolist(),
            "prefill_cpu_s_per_rank": gen_mem[2].tolist(),
            "ep": args.ep, **({"moe": moe} if moe is not None else {}),
            **({"profile": profile} if profile is not None else {})}
    compare = {}
    nproc_peer = world.size
    for peer in peers:
        bar.set_postfix_str(peer)
        if peer == "ours-1proc":
            metrics = run_ours_single_process(args)
        else:
            metrics = run_peer(peer, model, nproc_peer, args.batch, args.prompt_len, args.gen_len, args.peer_timeout,
                               repeats=args.repeat)
        metrics.pop("token_ids", None)
        metrics["prefill_ratio"] = _ratio(ours["prefill_tok_s"], metrics.get("prefill_tok_s"))
        metrics["decode_ratio"] = _ratio(ours["decode_tok_s"], metrics.get("decode_tok_s"))
        if not metrics.get("ok"):
            logger.warning(f"peer {peer} failed: {str(metrics.get('error'))[:500]}")
        compare[peer] = metrics
        bar.update(1)
    bar.close()
    print(f"bench: {os.path.basename(model.rstrip('/'))}, batch {args.batch} x prompt {args.prompt_len}, "
          f"{args.gen_len} new tokens, tp={args.tp} pp={args.pp} cp={args.cp} ep={args.ep} on {world.size} rank(s)")
    print(f"{'system':<14}{'prefill tok/s':>15}{'decode tok/s':>14}{'ttft ms':>10}{'tpot ms':>10}"
          f"{'prefill x':>11}{'decode x':>10}")
    rows = [("dist-infer", ours)] + [(k, v) for k, v in compare.items()]
    for name, m in rows:
        def fmt(v, scale=1.0, spec=".1f"):
            return format(v * scale, spec) if isinstance(v, (int, float)) and v else "-"
        print(f"{name:<14}{fmt(m.get('prefill_tok_s')):>15}{fmt(m.get('decode_tok_s')):>14}"
              f"{fmt(m.get('ttft_s'), 1e3):>10}{fmt(m.get('tpot_s'), 1e3):>10}"
              f"{fmt(m.get('prefill_ratio'), 1, '.2f'):>11}{fmt(m.get('decode_ratio'), 1, '.2f'):>10}")
    print("(x = dist-infer's throughput divided by the system's, same run)")
    print(f"prefill: {timing['ttft_s']:.3f} s for {args.batch} x {args.prompt_len} tokens (cp={args.cp}); "
          f"peak memory above the loaded model (KV cache + activations) per rank: "
          f"{', '.join(f'{m:.0f}' for m in gen_mem[1].tolist())} MiB "
          f"(peak RSS {', '.join(f'{m:.0f}' for m in gen_mem[0].tolist())} MiB); prefill CPU time per rank "
          f"{', '.join(f'{c:.2f}' for c in gen_mem[2].tolist())} s")
    if moe is not None:
        from dist_infer.models.moe import format_routing_report

        print(format_routing_report(moe))
    if profile is not None:
        from dist_infer.launch.profile import format_profile

        print(format_profile(profile))
    if args.save_routing:
        save_routing(args.save_routing, moe, args.ep)
    if overlap:
        ours["overlap"] = overlap
        print(format_overlap(overlap))
    if args.plot:
        plot(args.plot, [(n, m) for n, m in rows if m.get("ok", True)])
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps({**ours, "compare": compare}))
    return 0

"""`dist-infer bench`: prefill and decode throughput, side by side with the peers in the same run.

Our engine runs the workload first (all ranks), then rank 0 runs each peer named by --compare
in its own processes, one after another so they never share the cores, and reports our numbers
as ratios to theirs. Every system gets the same prompts (seeded B x P random ids) and the same
greedy loop shape: one prefill, then G-1 decode steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from typing import Optional

from loguru import logger

from dist_infer.topology.discovery import without_launcher_env

COMPARABLE = ("deepspeed", "hf", "hf-tp", "ours-1proc")


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the built-in small Llama)")
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many local ranks (default: tp x pp x ep x cp); ignored under a launcher")
    p.add_argument("--pp-split", default=None, help="layers per pipeline stage, comma separated")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (default %(default)s)")
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
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line (rank 0)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a bar chart of throughput per system")
    from dist_infer.launch.generate_cmd import add_cp_variant_flag

    add_cp_variant_flag(p)
    from dist_infer.launch.generate_cmd import add_expert_placement_flag

    add_expert_placement_flag(p)
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


def measure(engine, prompts, gen_len: int, repeat: int, progress) -> dict:
    from dist_infer.engine.sampling import SamplingParams

    engine.generate([p[:16] for p in prompts], SamplingParams(max_new_tokens=3, stop_at_eos=False))  # warm-up
    if hasattr(engine.stage, "reset_routing_stats"):
        engine.stage.reset_routing_stats()  # MoE routing statistics of the timed runs only
    best = None
    for _ in range(repeat):
        engine.generate(prompts, SamplingParams(max_new_tokens=gen_len, stop_at_eos=False))
        t = engine.timing.as_dict()
        if best is None or t["ttft_s"] + t["tpot_s"] * gen_len < best["ttft_s"] + best["tpot_s"] * gen_len:
            best = t
        progress()
    return best


def hidden_fraction(t_base: float, t_overlap: float, t_nocomm: float) -> float:
    """Share of the exposed communication time that overlap removed: (base - overlap) / (base - nocomm)."""
    exposed = t_base - t_nocomm
    return (t_base - t_overlap) / exposed if exposed > 0 else 0.0


def overlap_report(engine, tp, prompts, args, progress) -> dict:
    """Baseline, overlapped and no-communication runs of the same workload (TokenWeave's honest metric)."""
    runs = {}
    for name, mode, skip in (("base", "off", False), ("overlap", "on", False), ("nocomm", "off", True)):
        engine.overlap, tp.skip = mode, skip
        runs[name] = measure(engine, prompts, args.gen_len, args.repeat, progress)
    engine.overlap, tp.skip = args.overlap, False

    def phase(key: str) -> dict:
        t = {f"t_{n}_s": runs[n][key] for n in runs}
        return {**t, "hidden_fraction": hidden_fraction(t["t_base_s"], t["t_overlap_s"], t["t_nocomm_s"])}

    return {**phase("ttft_s"), "decode": phase("tpot_s"), "tokens_per_prefill": sum(len(p) for p in prompts)}


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
    from dist_infer.parallel.moe import write_routing_file

    if moe is None:
        raise SystemExit("dist-infer bench: --save-routing needs a mixture-of-experts model")
    write_routing_file(path, {i: layer["tokens_per_expert"] for i, layer in moe["layers"].items()}, ep)
    print(f"routing counts and a balanced placement for ep={ep} written to {path}")


def run_bench(args) -> int:
    import torch
    from tqdm import tqdm

    from dist_infer.comm.skipping import SkippableCommunicator
    from dist_infer.engine.generate import Engine
    from dist_infer.launch.generate_cmd import moe_report, overlap_options
    from dist_infer.launch.peers import make_prompts, run_peer
    from dist_infer.launch.rank import join_job
    from dist_infer.models.default_model import ensure_default_model
    from dist_infer.models.loader import load_stage
    from dist_infer.topology import ParallelConfig

    peers = parse_compare(args.compare)
    groups = join_job(args.backend, ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp),
                      args.timeout, args.iface, args.log_level, args.shm)
    world = groups.world
    model = args.model or str(ensure_default_model())
    split = [int(x) for x in args.pp_split.split(",")] if args.pp_split else None
    if args.overlap_report:
        groups = dataclasses.replace(groups, tp=SkippableCommunicator(groups.tp))
    stage, report = load_stage(model, groups, torch.float32, split, expert_placement=args.expert_placement)
    engine = Engine(stage, groups, args.block_size, **overlap_options(args), cp_variant=args.cp_variant)
    prompts = make_prompts(args.batch, args.prompt_len, stage.cfg.vocab_size).tolist()
    bar = tqdm(total=args.repeat * (4 if args.overlap_report else 1) + len(peers), desc="bench", unit="run", file=sys.stderr,
               disable=None if world.rank == 0 else True)
    timing, gen_peak, gen_above = generation_memory(
        lambda: measure(engine, prompts, args.gen_len, args.repeat, lambda: bar.update(1)))
    gen_mem = torch.zeros(3, world.size, dtype=torch.float64)
    gen_mem[:, world.rank] = torch.tensor([gen_peak or float("nan"), gen_above or float("nan"), timing["ttft_cpu_s"]])
    world.all_reduce(gen_mem)
    moe = moe_report(stage, groups)
    overlap = overlap_report(engine, groups.tp, prompts, args, lambda: bar.update(1)) if args.overlap_report else None
    peaks = torch.zeros(world.size, dtype=torch.float64)
    peaks[world.rank] = report.peak_rss_mb
    world.all_reduce(peaks)
    world.barrier()
    groups.destroy()
    world.destroy()
    if world.rank != 0:
        return 0
    ours = {"peer": "dist-infer", **timing, "peak_rss_mb": float(peaks.max()), "peak_rss_mb_per_rank": peaks.tolist(),
            "load_s": report.load_s, "tp": args.tp, "pp": args.pp, "world_size": world.size,
            "batch": args.batch, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "cp": args.cp, "cp_variant": args.cp_variant, "prefill_s": timing["ttft_s"],
            "gen_peak_rss_mb_per_rank": gen_mem[0].tolist(), "kv_act_peak_mb_per_rank": gen_mem[1].tolist(),
            "prefill_cpu_s_per_rank": gen_mem[2].tolist(),
            "ep": args.ep, **({"moe": moe} if moe is not None else {})}
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
    if args.save_routing:
        save_routing(args.save_routing, moe, args.ep)
    if overlap:
        ours["overlap"] = overlap
        for phase, label in (("prefill", "prefill (ttft)"), ("decode", "decode (per step)")):
            o = overlap[phase] if phase == "decode" else overlap
            print(f"overlap, {label}: base {o['t_base_s'] * 1e3:.1f} ms, overlapped {o['t_overlap_s'] * 1e3:.1f} ms, "
                  f"no communication {o['t_nocomm_s'] * 1e3:.1f} ms -> hidden fraction {o['hidden_fraction']:.2f}")
    if args.plot:
        plot(args.plot, [(n, m) for n, m in rows if m.get("ok", True)])
        print(f"plot written to {args.plot}")
    if args.json:
        print(json.dumps({**ours, "compare": compare}))
    return 0

"""`dist-infer bench --sweep "tp=1,2 pp=1,2 cp=1,2"`: one bench run per layout that fits this
machine, each beside the cost model's prediction for it (a calibrated profile of this machine),
as a table, JSON and a PNG, with the parallel efficiency of each layout against one rank."""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Optional, Sequence

from loguru import logger

from dist_infer.topology.cores import usable_cores
from dist_infer.topology.subcommand import SubcommandError, run_json

# flags of the bench command line the sweep sets per run (with how many values each takes)
_SET_PER_RUN = {
    "--sweep": 1,
    "--tp": 1,
    "--pp": 1,
    "--cp": 1,
    "--ep": 1,
    "--nproc": 1,
    "--json": 0,
    "--plot": 1,
    "--compare": 1,
    "--hardware-profile": 1,
    "--sweep-max-ranks": 1,
    "--sweep-speed-check": 1,
    "--sweep-rounds": 1,
    "--overlap-report": 0,
    "--profile": 1,
    "--save-routing": 1,
}


def child_argv(argv: Sequence[str]) -> list[str]:
    """The user's bench flags without the ones each sweep run sets itself."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name, eq, _ = arg.partition("=")
        if name in _SET_PER_RUN:
            skip = 0 if eq else _SET_PER_RUN[name]
            continue
        out.append(arg)
    return [a for a in out if a != "bench"]


def relative_error(predicted: float, measured: float) -> Optional[float]:
    return predicted / measured - 1.0 if measured else None


def efficiency(rows: list[dict], key: str) -> None:
    """Parallel efficiency of each row's `key` throughput against the sweep's one-rank run (or
    its smallest): (throughput / base throughput) / (ranks / base ranks)."""
    ok = [r for r in rows if r.get("measured")]
    if not ok:
        return
    base = min(ok, key=lambda r: r["ranks"])
    b = base["measured"][key]
    for r in ok:
        r[f"efficiency_{key}"] = (r["measured"][key] / b) / (r["ranks"] / base["ranks"]) if b else None


def machine_speed(reference: dict, now: dict) -> dict:
    """How fast the machine runs now against when its profile was calibrated: the ratios of the same
    two timings (a prefill's GEMM rate, the weight-streaming rate)."""
    return {
        "compute": now["gemm_flops"] / reference["gemm_flops"],
        "memory": now["stream_bandwidth"] / reference["stream_bandwidth"],
    }


def run_sweep(args, argv: Sequence[str]) -> int:
    from tqdm import tqdm

    from dist_infer.engine.engine_config import OVERLAP_THRESHOLDS
    from dist_infer.planner.calibrate import calibrate
    from dist_infer.planner.hardware import ProfileError, load_profile
    from dist_infer.planner.layout import LayoutError, parse_sweep, why_not
    from dist_infer.planner.plan import PlanError, model_shape
    from dist_infer.planner.predict import predict
    from dist_infer.planner.workload import Schedule, Workload

    if args.sweep_rounds < 1:
        print(f"dist-infer bench: --sweep-rounds {args.sweep_rounds}: run the layouts at least once (1 or more)")
        return 2
    try:
        layouts = parse_sweep(args.sweep)
        shape, path = model_shape(args.model)
        hw = load_profile(args.hardware_profile) if args.hardware_profile else None
    except (LayoutError, PlanError, ProfileError) as exc:
        print(f"dist-infer bench: --sweep: {exc}")
        return 2
    if hw is None:
        logger.info("no --hardware-profile: calibrating this machine first (dist-infer calibrate --quick)")
        hw = calibrate(quick=True)
    cores = usable_cores()
    max_ranks = args.sweep_max_ranks or 2 * cores
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[args.dtype]
    work = Workload(
        args.batch,
        args.prompt_len,
        args.gen_len,
        weight_dtype=dtype,
        act_dtype=dtype,
        attention_dtype=dtype,
        kv_dtype=dtype,
    )
    rows, runs, plans = [], [], {}  # plans: layout -> (Layout, Schedule) of the layouts that run
    for lay in layouts:
        problem = why_not(lay, shape)
        if problem is None and lay.ranks > max_ranks:
            problem = f"{lay.ranks} ranks is more than --sweep-max-ranks {max_ranks}"
        row = {**lay.as_dict(), "layout": lay.describe(), "ranks": lay.ranks}
        if problem is None:
            threshold = args.overlap_threshold or OVERLAP_THRESHOLDS["cpu" if hw.device == "cpu" else "cuda"]
            plans[row["layout"]] = (
                lay,
                Schedule(
                    overlap=args.overlap, overlap_threshold=threshold, ranks_per_node=lay.ranks, cores_per_node=cores
                ),
            )
            pred = predict(shape, lay, work, hw, plans[row["layout"]][1])
            row["predicted"] = pred.as_dict()
            if not pred.fits:
                problem = f"predicted {pred.memory_gib_per_rank:.1f} GiB per rank does not fit this machine"
        if problem:
            row["skipped"] = problem
        else:
            runs.append(row)
        rows.append(row)
    rounds = args.sweep_rounds
    bar = tqdm(total=rounds * len(runs), desc="sweep", unit="run", file=sys.stderr)
    base_cmd = ["bench"] + child_argv(argv)
    check_speed = args.sweep_speed_check == "on" and bool(hw.reference)
    if args.sweep_speed_check == "on" and not hw.reference:
        logger.info(
            f"sweep: profile {hw.name} has no reference timing (calibrate it again): predicting for the "
            f"machine as it was profiled"
        )
    for _ in range(rounds):  # every layout once per round, so that a slow stretch of time hits them alike
        for row in runs:
            if "error" in row:
                continue
            bar.set_postfix_str(row["layout"])
            run_layout(row, base_cmd, args, check_speed, hw, plans, shape, work)
            bar.update(1)
    bar.close()
    efficiency(rows, "prefill_tok_s")
    efficiency(rows, "decode_tok_s")
    print(format_sweep(rows, os.path.basename(path), args, hw.name))
    if args.plot:
        plot_sweep(args.plot, rows, args)
        print(f"plot written to {args.plot}")
    if args.json:
        print(
            json.dumps(
                {
                    "model": path,
                    "profile": hw.name,
                    "batch": args.batch,
                    "prompt_len": args.prompt_len,
                    "gen_len": args.gen_len,
                    "sweep": rows,
                }
            )
        )
    return 0 if all("error" not in r for r in rows) else 1


def run_layout(row: dict, base_cmd: list, args, check_speed: bool, hw, plans: dict, shape, work) -> None:
    """One launch of `row`'s layout; its measurements join the row's rounds, and the row's measured
    values are each metric's median over them (the largest peak memory), with the errors against
    the prediction."""
    from dist_infer.planner.predict import predict

    if check_speed and "measured" not in row:  # predict for the machine as fast as it is now (first round)
        try:
            speed = machine_speed(hw.reference, run_json(["calibrate", "--reference"], args.peer_timeout))
        except SubcommandError as exc:
            logger.warning(f"sweep: the speed check failed ({exc}); predicting at the profile's speed")
        else:
            row["machine_speed"] = speed
            row["predicted_at_profile_speed"] = row["predicted"]
            lay, sched = plans[row["layout"]]
            row["predicted"] = predict(
                shape, lay, work, hw.at_speed(speed["compute"], speed["memory"]), sched
            ).as_dict()
    cmd = base_cmd + [
        "--nproc",
        str(row["ranks"]),
        "--tp",
        str(row["tp"]),
        "--pp",
        str(row["pp"]),
        "--cp",
        str(row["cp"]),
        "--ep",
        str(row["ep"]),
        "--json",
    ]
    try:
        m = run_json(cmd, args.peer_timeout)
    except SubcommandError as exc:
        row["error"] = str(exc)
        logger.warning(f"sweep: {row['layout']} failed")
        return
    gen_peaks = [v for v in m.get("gen_peak_rss_mb_per_rank") or [] if v == v]  # NaN: not measured there
    now = {k: m[k] for k in ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s")}
    # the model predicts a decode step: compare it with the typical one, not a mean that one stall moves
    now["tpot_median_s"] = m.get("tpot_median_s") or m["tpot_s"]
    now["peak_rss_gib_per_rank"] = max(gen_peaks or [m["peak_rss_mb"]]) / 1024
    rounds = row.setdefault("rounds", [])
    rounds.append(now)
    # each metric's median over the launches: the typical launch, as calibrate's rates are the typical
    # ones (on a shared VM weights stream faster in some spells than in others: the best of several
    # launches is the lucky spell, not the machine; docs/benchmarks.md, "Choosing the layout: the
    # cost model against measurements")
    measured = row["measured"] = {k: statistics.median(r[k] for r in rounds) for k in now}
    measured["peak_rss_gib_per_rank"] = max(r["peak_rss_gib_per_rank"] for r in rounds)
    p = row["predicted"]
    row["ttft_error"] = relative_error(p["ttft_s"], measured["ttft_s"])
    row["tpot_error"] = relative_error(p["tpot_s"], measured["tpot_median_s"])
    row["memory_error"] = relative_error(p["memory_gib_per_rank"], measured["peak_rss_gib_per_rank"])


def format_sweep(rows: list[dict], model: str, args, profile: str) -> str:
    def pct(v):
        return f"{v:+.0%}" if isinstance(v, float) else "-"

    def num(v, scale=1.0, spec=".3f"):
        return format(v * scale, spec) if isinstance(v, (int, float)) else "-"

    def speed(s):
        return f"{s['compute']:.2f}/{s['memory']:.2f}" if s else "-"

    lines = [
        f"sweep: {model}, batch {args.batch} x prompt {args.prompt_len}, {args.gen_len} new tokens; predictions "
        f"from profile {profile}",
        f"{'layout':<14}{'ranks':>6}{'TTFT s':>9}{'pred':>9}{'err':>6}{'TPOT ms':>9}{'pred':>9}{'err':>6}"
        f"{'prefill tok/s':>15}{'eff':>6}{'decode tok/s':>14}{'eff':>6}{'GiB/rank':>10}{'pred':>7}{'err':>6}"
        f"{'speed':>11}",
    ]
    for r in rows:
        if "skipped" in r or "error" in r:
            why = (
                "skipped: " + r["skipped"] if "skipped" in r else "failed: " + r["error"].strip().splitlines()[-1][:90]
            )
            lines.append(f"{r['layout']:<14}{r['ranks']:>6}  {why}")
            continue
        m, p = r["measured"], r["predicted"]
        lines.append(
            f"{r['layout']:<14}{r['ranks']:>6}"
            f"{num(m['ttft_s']):>9}{num(p['ttft_s']):>9}{pct(r['ttft_error']):>6}"
            f"{num(m.get('tpot_median_s', m['tpot_s']), 1e3, '.1f'):>9}{num(p['tpot_s'], 1e3, '.1f'):>9}"
            f"{pct(r['tpot_error']):>6}"
            f"{num(m['prefill_tok_s'], 1, '.0f'):>15}{num(r.get('efficiency_prefill_tok_s'), 1, '.2f'):>6}"
            f"{num(m['decode_tok_s'], 1, '.0f'):>14}{num(r.get('efficiency_decode_tok_s'), 1, '.2f'):>6}"
            f"{num(m['peak_rss_gib_per_rank'], 1, '.2f'):>10}{num(p['memory_gib_per_rank'], 1, '.2f'):>7}"
            f"{pct(r['memory_error']):>6}"
            f"{speed(r.get('machine_speed')):>11}"
        )
    lines.append(
        "(err = predicted / measured - 1; TPOT = the median gap between a sequence's tokens; eff = throughput "
        "per rank against the smallest layout's; GiB/rank = the largest rank's peak RSS while generating; "
        "speed = the machine's GEMM / weight-streaming speed before the run against the profile's, which "
        "the prediction is made for)"
    )
    return "\n".join(lines)


def plot_sweep(path: str, rows: list[dict], args) -> None:
    """Measured prefill and decode tokens/s per layout (bars) with the prediction beside each (dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("measured")]
    fig, axes = plt.subplots(1, 2, figsize=(max(11.0, 1.5 * len(done)), 4.6))
    names = [r["layout"] for r in done]
    for ax, key, pkey, tokens, title in (
        (axes[0], "prefill_tok_s", "ttft_s", args.batch * args.prompt_len, "prefill tokens/s"),
        (axes[1], "decode_tok_s", "tpot_s", args.batch, "decode tokens/s (at the median step)"),
    ):
        # decode as compared: the batch's tokens per median step (a mean over few tokens holds one stall)
        measured = [r["measured"][key] if pkey == "ttft_s" else tokens / r["measured"]["tpot_median_s"] for r in done]
        predicted = [tokens / r["predicted"][pkey] if r["predicted"][pkey] else 0.0 for r in done]
        xs = range(len(done))
        bars = ax.bar([x - 0.18 for x in xs], measured, width=0.36, color="tab:green", label="measured")
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.bar([x + 0.18 for x in xs], predicted, width=0.36, color="tab:gray", alpha=0.6, label="predicted")
        effs = [r.get(f"efficiency_{key}") for r in done]
        ax.set_xticks(list(xs), [n + ("" if e is None else f"\neff {e:.2f}") for n, e in zip(names, effs)], fontsize=8)
        ax.set_title(title)
        ax.set_ylim(top=1.2 * max(measured + predicted + [1e-9]))  # room for the legend above the bars
        ax.legend(fontsize=8, ncols=2)
    fig.suptitle(f"dist-infer bench --sweep: batch {args.batch} x {args.prompt_len} tokens, {args.gen_len} new")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

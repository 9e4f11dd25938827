"""`dist-infer calibrate`: measure this machine into a hardware profile for the cost model.

Measured, per thread count a rank can have here: GEMM throughput against the row count (the
layers' shapes in decode and prefill), causal attention throughput against the sequence
length, and streaming bandwidth (a skinny product over weights far larger than the caches).
Then, in real multi-process jobs: every collective's latency and bus bandwidth from
`comm-test` (gloo and the shared-memory all-reduce, per group size), and the engine's fixed
costs per decoder layer and per step, timed on two random models that differ only in depth, in
one process and in every layout of 2 ranks (and of twice the cores): what a decode step's
collectives, hand-overs and merges cost inside the step loop, where the sum of per-op figures from
comm-test came out several times too low.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from typing import Callable

from loguru import logger

from dist_infer.planner.hardware import HardwareProfile, Link, save_profile
from dist_infer.planner.kernel_rates import (
    ATTENTION_LENGTHS,
    DECODE_CONTEXTS,
    GEMM_ROWS,
    STREAM_PLACEMENTS,
    STREAM_ROW_LENGTHS,
    measure_attention,
    measure_bandwidth,
    measure_decode_attention,
    measure_gemm,
    measure_reference,
    measure_size_factor,
)
from dist_infer.topology.cores import usable_cores
from dist_infer.topology.subcommand import SubcommandError, run_json

COMM_SIZES = "256,4K,64K,1M,4M"
COMM_OPS = ("all_reduce", "all_gather", "all_to_all", "send_recv")
FIXED_COST_DEPTHS = (4, 16)  # the narrow models' layers (4: pp=4 has a layer per stage)
NARROW = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)  # their width


def fit_link(points: list[tuple[float, float]]) -> Link:
    """latency = a + traffic / busbw through the smallest and the largest (traffic bytes, seconds)
    points: the smallest message fixes the latency, the largest the bandwidth."""
    (x0, y0), (x1, y1) = min(points), max(points)
    slope = max((y1 - y0) / (x1 - x0), 1e-15) if x1 > x0 else 1e-15
    return Link(latency_s=max(0.0, y0 - slope * x0), busbw=1.0 / slope)


def measure_collectives(cores: int, quick: bool, timeout: float) -> dict:
    """{op: {scope: {n: Link}}} from comm-test jobs: 2 ranks (gloo 'intra', the shared-memory
    all-reduce 'shm'); unless quick, also twice as many ranks as cores (scopes '-over': every
    group's collectives when the node's ranks outnumber its cores), as tp x cp groups and as one
    tp group."""
    from dist_infer.comm.selftest import bus_bandwidth_factor

    jobs = [(2, ["--tp", "2"], "")]
    if not quick:
        over = 2 * cores
        jobs += [(over, ["--tp", "2", "--cp", str(over // 2)], "-over"), (over, ["--tp", str(over)], "-over")]
    out: dict = {}
    for nproc, layout, suffix in jobs:
        res = run_json(
            [
                "launch",
                "--nproc-per-node",
                str(nproc),
                "--",
                sys.executable,
                "-m",
                "dist_infer",
                "comm-test",
                *layout,
                "--backend",
                "gloo",
                "--sizes",
                COMM_SIZES,
                "--json",
            ],
            timeout,
        )
        sizes = {"world": nproc}
        for i in range(0, len(layout), 2):
            sizes[layout[i][2:]] = int(layout[i + 1])
        for op in COMM_OPS:
            for group, n in sizes.items():
                scope = ("shm" if group == "tp" else "intra") + suffix
                if scope.startswith("shm") and op != "all_reduce":
                    continue
                pts = [
                    (r["bytes"] * bus_bandwidth_factor(op, n), r["latency_us"] * 1e-6)
                    for r in res["results"]
                    if r["op"] == op and r["group"] == group and r["bytes"] > 0
                ]
                if len(pts) >= 2:
                    out.setdefault(op, {}).setdefault(scope, {})[str(n)] = fit_link(pts)
    return out


def fixed_cost_layouts(cores: int, quick: bool) -> list:
    """The layouts whose decode fixed costs calibrate times: every one of 2 ranks, and unless
    quick every one of twice the cores (ranks sharing cores), that the narrow model runs."""
    from dist_infer.planner.layout import Layout, candidate_layouts
    from dist_infer.planner.shapes import ModelShape

    h, heads = NARROW["hidden_size"], NARROW["num_attention_heads"]
    shape = ModelShape(
        layers=FIXED_COST_DEPTHS[0],
        hidden=h,
        heads=heads,
        kv_heads=NARROW["num_key_value_heads"],
        head_dim=h // heads,
        intermediate=NARROW["intermediate_size"],
        vocab=1000,
    )  # (no vocab limit)
    sizes = [2] if quick else sorted({2, 2 * cores})
    return [Layout()] + [lay for n in sizes for lay in candidate_layouts(shape, n)]


def measure_fixed_costs(
    timeout: float, layouts: list, depths=FIXED_COST_DEPTHS, repeat: int = 5, gen_len: int = 64
) -> dict:
    """The engine's fixed costs, from two narrow random models (hidden 64: the arithmetic is
    negligible) that differ only in depth, each run in every layout of `layouts` (the first is
    one rank): per_layer_s / per_step_s (one rank's decode step against the depth) and, per
    layout, decode_fixed and prefill_fixed (the same slope and intercept in that layout, of the decode
    step and of the time to first token: the collectives' latencies, hand-overs, ring steps, merges
    and waits for a core as they happen inside the step loop). From cp=2 also
    cp_step_s (what one ring step adds per layer to a prefill) and cp_decode_layer_s, and from tp at
    twice the cores sync_oversubscribed_s: the per-op estimates for layouts not timed here.
    Each run is `repeat` timed generations of `gen_len` tokens (--quick: fewer and shorter)."""
    from dist_infer.models.tiny_model import write_tiny_model

    runs: dict = {}
    decode_step = "tpot_median_s"  # the typical decode step (as bench --sweep compares), not a mean one stall moves
    with tempfile.TemporaryDirectory(prefix="dist-infer-calibrate-") as tmp:
        for depth in depths:
            d = os.path.join(tmp, f"depth{depth}")
            os.makedirs(d)
            write_tiny_model(d, num_hidden_layers=depth, **NARROW)
            for lay in layouts:
                runs[depth, lay.describe()] = run_json(
                    [
                        "bench",
                        "--model",
                        d,
                        "--nproc",
                        str(lay.ranks),
                        "--tp",
                        str(lay.tp),
                        "--pp",
                        str(lay.pp),
                        "--cp",
                        str(lay.cp),
                        "--batch",
                        "1",
                        "--prompt-len",
                        "128",
                        "--gen-len",
                        str(gen_len),
                        "--repeat",
                        str(repeat),
                        "--json",
                    ],
                    timeout,
                )
    lo, hi = depths

    def slope(key: str, run: str) -> float:
        return (runs[hi, run][key] - runs[lo, run][key]) / (hi - lo)

    def step(run: str, per_layer: float, key: str = decode_step) -> float:
        return max(0.0, runs[lo, run][key] - lo * per_layer)

    def fixed(lay, key: str = decode_step) -> dict:
        """The layout's fixed costs per layer and per step: the timings' slope and intercept."""
        layer = max(0.0, slope(key, lay.describe()))
        return {"per_layer_s": layer, "per_step_s": step(lay.describe(), layer, key)}

    one = layouts[0].describe()
    per_layer = max(0.0, slope(decode_step, one))
    out: dict = {**fixed(layouts[0]), "decode_fixed": {}, "prefill_fixed": {}}
    # a rank's memory beside its model: the one-rank run's peak while generating, its model (a few
    # hundred KiB) aside: the interpreter, torch, the engine, the allocator's pools
    peaks = [v for v in runs[lo, one].get("gen_peak_rss_mb_per_rank") or [] if v == v]
    if peaks:
        out["base_memory_bytes"] = max(peaks) * (1 << 20)
    for lay in layouts[1:]:
        out["decode_fixed"][lay.describe()] = fixed(lay)
        # the prefill's too: the narrow model's 128-token prompt is little arithmetic per layer next
        # to what a layer's ring steps, all-reduces and waits cost in a layout of ranks
        out["prefill_fixed"][lay.describe()] = fixed(lay, "ttft_s")
    if "cp=2" in out["decode_fixed"]:
        out["cp_decode_layer_s"] = max(0.0, slope(decode_step, "cp=2") - per_layer)
        out["cp_step_s"] = max(0.0, slope("ttft_s", "cp=2") - slope("ttft_s", one))
    crowd = [lay.describe() for lay in layouts[1:] if lay.tp == lay.ranks and lay.ranks > 2]
    if crowd:  # every rank of one tp group sharing the cores: two all-reduces per layer
        out["sync_oversubscribed_s"] = max(0.0, (slope(decode_step, crowd[0]) - per_layer) / 2)
    zero = [k for k, v in out.items() if v == 0.0] + [
        f"{kind}[{n}]"
        for kind in ("decode_fixed", "prefill_fixed")
        for n, v in out[kind].items()
        if v["per_layer_s"] == 0.0
    ]
    if zero:  # a difference of two timings came out negative: noise larger than the cost
        logger.warning(
            f"calibrate: {', '.join(zero)} measured as 0 (timing noise above the cost: is the machine "
            f"busy? rerun calibrate when it is quiet)"
        )
    return out


def calibrate(
    quick: bool = False, timeout: float = 600.0, progress: Callable[[str], None] = lambda s: None
) -> HardwareProfile:
    import psutil

    cores = usable_cores()
    thread_counts = sorted({1, cores})
    gemm, attention, attention_full, bandwidth, reader, decode_attention, size_factor = {}, {}, {}, {}, "", {}, {}
    stream_mib, stream_rows = (64, STREAM_ROW_LENGTHS[1::2]) if quick else (256, STREAM_ROW_LENGTHS)
    stream_samples: dict = {t: {} for t in thread_counts}  # both looks' rates, by thread count and row length
    for t in thread_counts:
        progress(f"GEMM, {t} thread(s)")
        gemm[str(t)] = measure_gemm(t, GEMM_ROWS[::2] if quick else GEMM_ROWS)
        progress(f"attention, {t} thread(s)")
        attention[str(t)] = measure_attention(t, ATTENTION_LENGTHS[:3] if quick else ATTENTION_LENGTHS)
        attention_full[str(t)] = measure_attention(
            t, ATTENTION_LENGTHS[:3] if quick else ATTENTION_LENGTHS, causal=False
        )
        progress(f"memory bandwidth, {t} thread(s)")
        bandwidth[str(t)], reader = measure_bandwidth(t, stream_mib, stream_rows, STREAM_PLACEMENTS, stream_samples[t])
        # --quick (tests, bench --sweep's default): shorter timings and fewer rounds, for the shape of the
        # curves more than their last percent
        decode_attention[str(t)] = measure_decode_attention(
            t,
            DECODE_CONTEXTS[1:3] if quick else DECODE_CONTEXTS,
            80 if quick else 160,
            min_s=0.04 if quick else 0.2,
            reps=2 if quick else 3,
            placements=2 if quick else 3,
        )
        size_factor[str(t)] = measure_size_factor(t, 64 if quick else 256, rounds=2 if quick else 3)
    reference = measure_reference(cores)
    progress("collectives (comm-test)")
    collectives = measure_collectives(cores, quick, timeout)
    progress("fixed costs per layer and per step, per layout (bench)")
    fixed = measure_fixed_costs(
        timeout, fixed_cost_layouts(cores, quick), repeat=3 if quick else 5, gen_len=32 if quick else 64
    )
    for t in thread_counts:  # the second look at streaming, minutes after the first
        progress(f"memory bandwidth again, {t} thread(s)")
        bandwidth[str(t)], reader = measure_bandwidth(t, stream_mib, stream_rows, STREAM_PLACEMENTS, stream_samples[t])
    fixed.setdefault("base_memory_bytes", float(psutil.Process().memory_info().rss))  # (no /proc: this process)
    links = {"intra": collectives["send_recv"]["intra"]["2"]}
    return HardwareProfile(
        name=f"{platform.node()}-cpu{cores}",
        device="cpu",
        gemm_flops={"fp32": gemm},
        attention_flops={"fp32": attention},
        attention_flops_full={"fp32": attention_full},
        memory_bandwidth=bandwidth,
        decode_attention_bandwidth=decode_attention if all(decode_attention.values()) else 0.0,
        stream_size_factor=size_factor if all(size_factor.values()) else {},
        memory_bytes=float(psutil.virtual_memory().total),
        devices_per_node=cores,
        links=links,
        collectives=collectives,
        shared_node=True,
        comm_overlaps_compute=False,
        reference=reference,
        **fixed,
        sources={
            "all": f"measured by `dist-infer calibrate{' --quick' if quick else ''}` on {platform.node()} "
            f"({platform.processor() or platform.machine()}, {cores} usable cores), "
            f"{time.strftime('%Y-%m-%d %H:%M')}",
            "memory_bandwidth": f"by row length (input features): 4-row products over {64 if quick else 256} "
            f"MiB of fp32 weights in 16 matrices, with {reader}",
        },
        notes="memory_bytes is the node's; ranks on the node share it. comm_overlaps_compute is false: on a CPU "
        "node a transfer's copies need the cores the compute runs on, so the model hides nothing behind it",
    )


def run_calibrate(args) -> int:
    from tqdm import tqdm

    if args.reference:
        print(json.dumps(measure_reference(usable_cores())))
        return 0

    steps = 4 * len({1, usable_cores()}) + 2
    bar = tqdm(total=steps, desc="calibrate", unit="step", file=sys.stderr)

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(1)

    try:
        profile = calibrate(args.quick, args.timeout, progress)
    except SubcommandError as exc:
        bar.close()
        logger.error(f"calibrate: {exc}")
        return 1
    bar.close()
    save_profile(profile, args.out)
    g = profile.gemm_rate("fp32", profile.devices_per_node)
    streamed = [profile.bandwidth(profile.devices_per_node, k) for k in STREAM_ROW_LENGTHS]
    print(
        f"calibrate: {profile.name}: GEMM {g / 1e9:.1f} GFLOP/s ({profile.devices_per_node} threads, large), "
        f"weights streamed at {min(streamed) / 1e9:.1f}-{max(streamed) / 1e9:.1f} GB/s (by row length), "
        f"all-reduce (shm, 2 ranks) latency {profile.link('all_reduce', 2, 'shm').latency_s * 1e6:.0f} us, "
        f"per layer {profile.per_layer_s * 1e6:.0f} us, per step {profile.per_step_s * 1e3:.2f} ms, cp ring step "
        f"{profile.cp_step_s * 1e6:.0f} us, cp decode merge {profile.cp_decode_layer_s * 1e6:.0f} us per layer"
    )
    print(f"profile written to {args.out}")
    if args.json:
        print(json.dumps(profile.to_json()))
    return 0

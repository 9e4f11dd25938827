"""`dist-infer calibrate`: measure this machine into a hardware profile for the cost model.

Measured, per thread count a rank can have here: GEMM throughput against the row count (the
layers' shapes in decode and prefill), causal attention throughput against the sequence
length, and streaming bandwidth (a skinny product over weights far larger than the caches).
Then, in real multi-process jobs: every collective's latency and bus bandwidth from
`comm-test` (gloo and the shared-memory all-reduce, per group size), and the engine's fixed
costs per decoder layer and per step, timed on two random models that differ only in depth, in
one process and in every layout of 2 ranks (and of twice the cores): what a decode step's
collectives, hand-overs and merges cost inside the step loop, where per-op figures from comm-test
came out 2-4x too low on this machine.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Callable, Optional

from loguru import logger

from dist_infer.launch.cost_model.hardware import HardwareProfile, Link, save_profile
from dist_infer.launch.subcommand import SubcommandError, run_json

GEMM_ROWS = (1, 4, 16, 64, 256, 1024, 4096)
GEMM_SHAPE = (1024, 4096)  # in, out: 16 MiB of fp32 weights, beyond this machine's caches
ATTENTION_LENGTHS = (128, 512, 2048, 8192)
ATTENTION_HEAD_DIMS = (32, 64, 128)
STREAM_ROW_LENGTHS = (512, 1024, 2048, 4096, 8192)  # a weight matrix's input features
COMM_SIZES = "256,4K,64K,1M,4M"
COMM_OPS = ("all_reduce", "all_gather", "all_to_all", "send_recv")
FIXED_COST_DEPTHS = (4, 16)  # the narrow models' layers (4: pp=4 has a layer per stage)
NARROW = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)  # their width


def _best_time(fn: Callable[[], object], min_s: float = 0.2, max_reps: int = 50) -> float:
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or (spent < min_s and reps < max_reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def _sustained_time(fn: Callable[[], object], min_s: float = 0.3, warm_s: float = 0.0, reps: int = 5,
                    max_reps: int = 30) -> float:
    """The median of at least `reps` timings of `fn` after `warm_s` seconds of running it: the rate
    memory sustains. On this VM memory streams at about 45 GB/s for a second after an idle spell,
    and in spells of 2-3 passes now and then, and at about 30 GB/s otherwise; a decode runs for
    seconds, so the best pass overstates it by half (the snapshot noise of calibrates before)."""
    start = time.perf_counter()
    fn()
    while time.perf_counter() - start < warm_s:
        fn()
    times: list[float] = []
    while len(times) < reps or (sum(times) < min_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


MEMORY_WARM_S = 1.5  # streaming before the first memory-bound timing (past the after-idle burst)
STREAM_PLACEMENTS = 3  # fresh allocations per look at the streaming rate (calibrate looks twice)


def measure_gemm(threads: int, rows=GEMM_ROWS, passes: int = 2) -> list[list[float]]:
    """[[rows, FLOP/s]] of fp32 x[rows, 1024] @ W[4096, 1024]^T, through what the engine would
    use: the native skinny kernel for the few rows it takes, torch's GEMM otherwise. Each point is
    the best of `passes` passes over the row counts a second or two apart: a slow stretch of this
    VM can cover one point's whole timing (one calibrate read 65 GFLOP/s at 256 rows, the others
    90-94), and a prefill is timed at its best of `--repeat` runs."""
    import torch
    import torch.nn.functional as F

    from dist_infer.kernels.build import MAX_ROWS, load_cpu_kernels

    torch.set_num_threads(threads)
    kernels = load_cpu_kernels()
    k, n = GEMM_SHAPE
    w = torch.randn(n, k)
    best = {m: 0.0 for m in rows}
    for _ in range(passes):
        for m in rows:
            x = torch.randn(m, k)
            native = kernels is not None and m <= MAX_ROWS
            fn = (lambda: kernels.skinny_linear(x, w)) if native else (lambda: F.linear(x, w))
            best[m] = max(best[m], 2.0 * m * k * n / _best_time(fn))
    return [[m, best[m]] for m in rows]


def measure_attention(threads: int, lengths=ATTENTION_LENGTHS, head_dims=ATTENTION_HEAD_DIMS,
                      heads: int = 8, causal: bool = True) -> dict:
    """{head_dim: [[tokens, FLOP/s]]} of a causal prefill's attention as the engine calls it: 8 query
    heads on 4 KV heads (GQA), [tokens, heads, d] views, torch's SDPA. The rate depends on the head
    size (a head of 32 has half the arithmetic per byte of one of 64). `causal=False`: a square
    block with no mask, as a cp ring attends another rank's keys (FLOPs: every pair, not half)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    out = {}
    for d in head_dims:
        out[str(d)] = []
        for t_len in lengths:
            q = torch.randn(1, t_len, heads, d)
            k, v = torch.randn(1, t_len, heads // 2, d), torch.randn(1, t_len, heads // 2, d)
            t = _best_time(lambda: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True))
            pairs = t_len * (t_len + 1) / 2 if causal else t_len * t_len
            out[str(d)].append([t_len, 4.0 * d * heads * pairs / t])
    return out


def measure_bandwidth(threads: int, mib: int = 256, row_lengths=STREAM_ROW_LENGTHS, placements: int = 5,
                      samples: Optional[dict] = None) -> tuple[list[list[float]], str]:
    """([[row length, bytes/s]], what read them): weights far larger than the caches streamed through
    4-row products, as a decode step reads them, with the engine's native skinny kernel when it
    builds here (what decode uses by default), else torch's. The weights are 16 matrices of rows of
    each length, as a model's layers are: the rate depends on the row length (on the 2-core machine
    31 GB/s for 512 to 1536 floats, 24 GB/s for 4096), not on how the bytes are split. Each rate is
    the median over `placements` fresh allocations timed one after the other: on this VM two threads
    stream at 45-55 GB/s in some spells and about 30 in others (the vCPUs' placement on the host,
    likely), and one allocation's timing can fall in a short spell. `samples` ({row length: [rates]},
    given): this call's rates join those of earlier calls, and the medians are over all of them
    (calibrate looks twice, minutes apart, as a spell can last minutes)."""
    import torch
    import torch.nn.functional as F

    from dist_infer.kernels import load_cpu_kernels

    torch.set_num_threads(threads)
    kernels = load_cpu_kernels()
    product = kernels.skinny_linear if kernels is not None else (lambda a, w: F.linear(a, w))
    out = []
    warm = MEMORY_WARM_S
    for k in row_lengths:
        rates = samples.setdefault(k, []) if samples is not None else []
        for _ in range(placements):
            ws = [torch.empty(max(1, mib * (1 << 20) // (4 * k * 16)), k).fill_(0.5) for _ in range(16)]
            x = torch.randn(4, k)

            def run():
                for w in ws:
                    product(x, w)

            rates.append(sum(w.numel() for w in ws) * 4 / _sustained_time(run, min_s=0.3, warm_s=warm))
            warm = 0.0
            del ws
        out.append([k, statistics.median(rates)])
    return out, "the native skinny kernel" if kernels is not None else "torch F.linear"


DECODE_KV_HEADS = (1, 2, 3, 4, 6, 8)  # KV heads on a rank (each with two query heads)
DECODE_CONTEXTS = (1024, 4096, 8192, 16384)  # tokens of one sequence's cache on a rank


def measure_decode_attention(threads: int, contexts=DECODE_CONTEXTS, mib: int = 160, head_dims=ATTENTION_HEAD_DIMS,
                             kv_heads=DECODE_KV_HEADS, placements: int = 3) -> dict:
    """{head_dim: {kv_heads: [[context, KV bytes/s]]}} the native paged decode attention reads: one
    query, `kv_heads` KV heads with two query heads each, over caches cycled through `mib` MiB so
    that they come from memory, as a model's layers' do, not from the CPU's caches (8 copies of a
    4K context at heads of 32 fit in this machine's 32 MiB L3 and read 10% faster). The rate depends
    on the head size, the KV heads and the context: the kernel splits the keys in chunks shared by
    the threads, and a short context has few chunks and pays the merge (on the 2-core machine, two
    threads: 4 heads of 32 at 10.6 GB/s at 1K, 13.6 at 16K; 3 heads of 64 at 15.4 and 17.3; an
    older kernel that read one KV head at a time slowed with more heads and longer contexts, 4
    heads of 32: 3.6 GB/s at 4K, 2.3 at 16K). The caches lie in `placements` separate buffers of
    `mib` MiB, each pass reading all of them (with that older kernel the same read measured 2.3 and
    3.2 GB/s at 4 heads of 32 and 8K in two processes minutes apart, one buffer each).
    {} without the native kernels (the model then uses the memory bandwidth)."""
    import torch

    from dist_infer.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        return {}
    torch.set_num_threads(threads)
    bs = 16
    pools = [torch.randn(mib * (1 << 20) // 4) for _ in range(placements)]  # each viewed as each shape's caches
    out: dict = {}
    warm = MEMORY_WARM_S
    for d in head_dims:
        out[str(d)] = {}
        for kv in kv_heads:
            out[str(d)][str(kv)] = []
            for context in contexts:
                nb = context // bs + 1
                tables = torch.arange(nb, dtype=torch.long).view(1, -1)
                lens = torch.full((1,), context, dtype=torch.long)
                one = nb * bs * kv * d  # floats in one layer's K (or V)
                caches = [(pool[i * 2 * one:(i * 2 + 1) * one].view(nb, bs, kv, d),
                           pool[(i * 2 + 1) * one:(i * 2 + 2) * one].view(nb, bs, kv, d))
                          for pool in pools for i in range(pool.numel() // (2 * one))]
                if not caches:
                    raise ValueError(f"calibrate: a {context}-token cache of {kv} heads of {d} does not fit in "
                                     f"{mib} MiB")
                q = torch.randn(1, 2 * kv * d)

                def run():
                    for kc, vc in caches:
                        kernels.decode_attention(q, kc, vc, tables, lens, None, 0.1)

                t = _sustained_time(run, min_s=0.2, warm_s=warm, reps=3)
                warm = 0.0
                out[str(d)][str(kv)].append([context, len(caches) * context * kv * d * 4 * 2 / t])
    return out


STREAM_SIZES_MIB = (0.25, 1, 4, 16)  # weight matrices' sizes (16 MiB: what measure_bandwidth streams)


def measure_size_factor(threads: int, mib: int = 256, sizes=STREAM_SIZES_MIB, rounds: int = 3) -> list[list[float]]:
    """[[matrix bytes, factor]]: how fast 4-row products stream matrices of each size (rows of 1024
    floats, cycled through `mib` MiB so that every one comes from memory) against the largest. A
    model's matrices are small (SmolLM2's 1-7 MiB) and each pays its call, the wake of the other
    threads and the prefetchers' start: on the 2-core machine 0.82 of the large matrices' rate at
    1.3 MiB with two threads, 0.94 at 9 MiB. Each factor is the median over `rounds` rounds of every
    size, each against its own round's largest: a ratio of two timings seconds apart moves with this
    VM's memory spells (one calibrate read 0.76 at 4 MiB, the others 0.95-0.97)."""
    import torch

    from dist_infer.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None:
        return []
    torch.set_num_threads(threads)
    k = 1024
    pool = torch.randn(mib * (1 << 20) // 4)
    x = torch.randn(4, k)
    factors: dict[float, list[float]] = {}
    warm = MEMORY_WARM_S
    for _ in range(rounds):
        rates = []
        for size in sizes:
            n = max(1, int(size * (1 << 20)) // (4 * k))
            ws = [pool[i * n * k:(i + 1) * n * k].view(n, k) for i in range(pool.numel() // (n * k))]

            def run():
                for w in ws:
                    kernels.skinny_linear(x, w)

            t = _sustained_time(run, min_s=0.3, warm_s=warm)
            warm = 0.0
            rates.append((n * k * 4.0, len(ws) * n * k * 4.0 / t))
        for nbytes, rate in rates:
            factors.setdefault(nbytes, []).append(rate / rates[-1][1])
    return [[nbytes, statistics.median(f)] for nbytes, f in factors.items()]


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
    from dist_infer.launch.comm_test import bus_bandwidth_factor

    jobs = [(2, ["--tp", "2"], "")]
    if not quick:
        over = 2 * cores
        jobs += [(over, ["--tp", "2", "--cp", str(over // 2)], "-over"), (over, ["--tp", str(over)], "-over")]
    out: dict = {}
    for nproc, layout, suffix in jobs:
        res = run_json(["launch", "--nproc-per-node", str(nproc), "--",
                        sys.executable, "-m", "dist_infer", "comm-test", *layout, "--backend", "gloo",
                         "--sizes", COMM_SIZES, "--json"], timeout)
        sizes = {"world": nproc}
        for i in range(0, len(layout), 2):
            sizes[layout[i][2:]] = int(layout[i + 1])
        for op in COMM_OPS:
            for group, n in sizes.items():
                scope = ("shm" if group == "tp" else "intra") + suffix
                if scope.startswith("shm") and op != "all_reduce":
                    continue
                pts = [(r["bytes"] * bus_bandwidth_factor(op, n), r["latency_us"] * 1e-6) for r in res["results"]
                       if r["op"] == op and r["group"] == group and r["bytes"] > 0]
                if len(pts) >= 2:
                    out.setdefault(op, {}).setdefault(scope, {})[str(n)] = fit_link(pts)
    return out


def fixed_cost_layouts(cores: int, quick: bool) -> list:
    """The layouts whose decode fixed costs calibrate times: every one of 2 ranks, and unless
    quick every one of twice the cores (ranks sharing cores), that the narrow model runs."""
    from dist_infer.launch.cost_model.layout import Layout, candidate_layouts
    from dist_infer.launch.cost_model.shapes import ModelShape

    h, heads = NARROW["hidden_size"], NARROW["num_attention_heads"]
    shape = ModelShape(layers=FIXED_COST_DEPTHS[0], hidden=h, heads=heads, kv_heads=NARROW["num_key_value_heads"],
                       head_dim=h // heads, intermediate=NARROW["intermediate_size"], vocab=1000)  # (no vocab limit)
    sizes = [2] if quick else sorted({2, 2 * cores})
    return [Layout()] + [lay for n in sizes for lay in candidate_layouts(shape, n)]


REFERENCE_ROWS, REFERENCE_ROW_LENGTH = 256, 1024  # a prefill's GEMM, a decode's weight streaming


def measure_reference(threads: int) -> dict:
    """The machine's speed right now in about a second: the GEMM rate for a prefill's rows and the
    rate weights stream at, with `threads` threads. calibrate stores it in the profile; `bench
    --sweep` takes it again before each layout: on a shared VM the same microbenchmarks move by a
    third within minutes (a noisy neighbour), and a prediction is for the machine as it is."""
    gemm = measure_gemm(threads, (REFERENCE_ROWS,))[0][1]
    stream = measure_bandwidth(threads, 256, (REFERENCE_ROW_LENGTH,))[0][0][1]
    return {"threads": threads, "gemm_flops": gemm, "stream_bandwidth": stream}


def measure_fixed_costs(timeout: float, layouts: list, depths=FIXED_COST_DEPTHS) -> dict:
    """The engine's fixed costs, from two narrow random models (hidden 64: the arithmetic is
    negligible) that differ only in depth, each run in every layout of `layouts` (the first is
    one rank): per_layer_s / per_step_s (one rank's decode step against the depth) and, per
    layout, decode_fixed and prefill_fixed (the same slope and intercept in that layout, of the decode
    step and of the time to first token: the collectives' latencies, hand-overs, ring steps, merges
    and waits for a core as they happen inside the step loop). From cp=2 also
    cp_step_s (what one ring step adds per layer to a prefill) and cp_decode_layer_s, and from tp at
    twice the cores sync_oversubscribed_s: the per-op estimates for layouts not timed here."""
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
                    ["bench", "--model", d, "--nproc", str(lay.ranks), "--tp", str(lay.tp), "--pp", str(lay.pp),
                     "--cp", str(lay.cp), "--batch", "1", "--prompt-len", "128", "--gen-len", "64", "--repeat", "5",
                     "--json"], timeout)
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
        # the prefill's too: the narrow model's 128-token prompt is ~0.1 ms of arithmetic per layer,
        # against the 0.5-5 ms a layer's ring steps, all-reduces and waits cost in a layout of ranks
        out["prefill_fixed"][lay.describe()] = fixed(lay, "ttft_s")
    if "cp=2" in out["decode_fixed"]:
        out["cp_decode_layer_s"] = max(0.0, slope(decode_step, "cp=2") - per_layer)
        out["cp_step_s"] = max(0.0, slope("ttft_s", "cp=2") - slope("ttft_s", one))
    crowd = [lay.describe() for lay in layouts[1:] if lay.tp == lay.ranks and lay.ranks > 2]
    if crowd:  # every rank of one tp group sharing the cores: two all-reduces per layer
        out["sync_oversubscribed_s"] = max(0.0, (slope(decode_step, crowd[0]) - per_layer) / 2)
    zero = [k for k, v in out.items() if v == 0.0] + [f"{kind}[{n}]" for kind in ("decode_fixed", "prefill_fixed")
                                                     for n, v in out[kind].items() if v["per_layer_s"] == 0.0]
    if zero:  # a difference of two timings came out negative: noise larger than the cost
        logger.warning(f"calibrate: {', '.join(zero)} measured as 0 (timing noise above the cost: is the machine "
                       f"busy? rerun calibrate when it is quiet)")
    return out


def calibrate(quick: bool = False, timeout: float = 600.0, progress: Callable[[str], None] = lambda s: None) -> HardwareProfile:
    import psutil

    from dist_infer.launch.launcher import usable_cores

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
        attention_full[str(t)] = measure_attention(t, ATTENTION_LENGTHS[:3] if quick else ATTENTION_LENGTHS,
                                                   causal=False)
        progress(f"memory bandwidth, {t} thread(s)")
        bandwidth[str(t)], reader = measure_bandwidth(t, stream_mib, stream_rows, STREAM_PLACEMENTS,
                                                      stream_samples[t])
        decode_attention[str(t)] = measure_decode_attention(t, DECODE_CONTEXTS[1:3] if quick else DECODE_CONTEXTS,
                                                            80 if quick else 160)
        size_factor[str(t)] = measure_size_factor(t, 128 if quick else 256)
    reference = measure_reference(cores)
    progress("collectives (comm-test)")
    collectives = measure_collectives(cores, quick, timeout)
    progress("fixed costs per layer and per step, per layout (bench)")
    fixed = measure_fixed_costs(timeout, fixed_cost_layouts(cores, quick))
    for t in thread_counts:  # the second look at streaming, minutes after the first
        progress(f"memory bandwidth again, {t} thread(s)")
        bandwidth[str(t)], reader = measure_bandwidth(t, stream_mib, stream_rows, STREAM_PLACEMENTS,
                                                      stream_samples[t])
    fixed.setdefault("base_memory_bytes", float(psutil.Process().memory_info().rss))  # (no /proc: this process)
    links = {"intra": collectives["send_recv"]["intra"]["2"]}
    return HardwareProfile(
        name=f"{platform.node()}-cpu{cores}", device="cpu",
        gemm_flops={"fp32": gemm}, attention_flops={"fp32": attention}, attention_flops_full={"fp32": attention_full},
        memory_bandwidth=bandwidth,
        decode_attention_bandwidth=decode_attention if all(decode_attention.values()) else 0.0,
        stream_size_factor=size_factor if all(size_factor.values()) else {},
        memory_bytes=float(psutil.virtual_memory().total), devices_per_node=cores, links=links,
        collectives=collectives, shared_node=True, comm_overlaps_compute=False, reference=reference, **fixed,
        sources={"all": f"measured by `dist-infer calibrate{' --quick' if quick else ''}` on {platform.node()} "
                        f"({platform.processor() or platform.machine()}, {cores} usable cores), "
                        f"{time.strftime('%Y-%m-%d %H:%M')}",
                 "memory_bandwidth": f"by row length (input features): 4-row products over {64 if quick else 256} "
                                     f"MiB of fp32 weights in 16 matrices, with {reader}"},
        notes="memory_bytes is the node's; ranks on the node share it. comm_overlaps_compute is false: on a CPU "
              "node a transfer's copies need the cores the compute runs on, so the model hides nothing behind it")


def run_calibrate(args) -> int:
    from tqdm import tqdm

    from dist_infer.launch.launcher import usable_cores

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
    print(f"calibrate: {profile.name}: GEMM {g / 1e9:.1f} GFLOP/s ({profile.devices_per_node} threads, large), "
          f"weights streamed at {min(streamed) / 1e9:.1f}-{max(streamed) / 1e9:.1f} GB/s (by row length), "
          f"all-reduce (shm, 2 ranks) latency {profile.link('all_reduce', 2, 'shm').latency_s * 1e6:.0f} us, "
          f"per layer {profile.per_layer_s * 1e6:.0f} us, per step {profile.per_step_s * 1e3:.2f} ms, cp ring step "
          f"{profile.cp_step_s * 1e6:.0f} us, cp decode merge {profile.cp_decode_layer_s * 1e6:.0f} us per layer")
    print(f"profile written to {args.out}")
    if args.json:
        print(json.dumps(profile.to_json()))
    return 0

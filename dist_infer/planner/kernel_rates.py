"""What one rank's kernels run at on this machine, timed in this process: GEMM and attention
throughput, the rate weights and KV caches stream at. calibrate stores them in a CPU profile; `bench
--sweep` takes the reference pair again before each layout. Kept apart from calibrate's multi-process
jobs because these are the memory-timing subtleties (a VM's after-idle bursts, placements)."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Optional

GEMM_ROWS = (1, 4, 16, 64, 256, 1024, 4096)
GEMM_SHAPE = (1024, 4096)  # in, out: 16 MiB of fp32 weights, beyond this machine's caches
ATTENTION_LENGTHS = (128, 512, 2048, 8192)
ATTENTION_HEAD_DIMS = (32, 64, 128)
STREAM_ROW_LENGTHS = (512, 1024, 2048, 4096, 8192)  # a weight matrix's input features


def _best_time(fn: Callable[[], object], min_s: float = 0.2, max_reps: int = 50) -> float:
    fn()
    best, spent, reps = float("inf"), 0.0, 0
    while reps < 3 or (spent < min_s and reps < max_reps):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def _sustained_time(
    fn: Callable[[], object], min_s: float = 0.3, warm_s: float = 0.0, reps: int = 5, max_reps: int = 30
) -> float:
    """The median of at least `reps` timings of `fn` after `warm_s` seconds of running it: the rate
    memory sustains. On a shared VM memory streams faster for a second after an idle spell, and in
    spells of a few passes now and then, than otherwise (docs/benchmarks.md, "Choosing the layout:
    the cost model against measurements"); a decode runs for seconds, so the best pass overstates it
    (the snapshot noise of earlier calibrates)."""
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
    use: the native skinny kernel for the few rows it takes, the native kernels' GEMM (oneDNN's where
    it loads) or torch's otherwise. Each point is
    the best of `passes` passes over the row counts a second or two apart: a slow stretch of a
    shared VM can cover one point's whole timing (one calibrate once read one point far below the
    others), and a prefill is timed at its best of `--repeat` runs."""
    import torch
    import torch.nn.functional as F

    from dist_infer.kernels import MAX_ROWS, load_cpu_kernels

    torch.set_num_threads(threads)
    kernels = load_cpu_kernels()
    k, n = GEMM_SHAPE
    w = torch.randn(n, k)
    best = {m: 0.0 for m in rows}
    for _ in range(passes):
        for m in rows:
            x = torch.randn(m, k)
            # what the engine runs: skinny rows native, many through the kernels' GEMM
            product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
            if kernels is not None:
                if m <= MAX_ROWS:
                    product = kernels.skinny_linear
                elif kernels.gemm is not None:
                    product = kernels.gemm.linear
            fn = functools.partial(product, x, w)
            best[m] = max(best[m], 2.0 * m * k * n / _best_time(fn))
    return [[m, best[m]] for m in rows]


def measure_attention(
    threads: int, lengths=ATTENTION_LENGTHS, head_dims=ATTENTION_HEAD_DIMS, heads: int = 8, causal: bool = True
) -> dict:
    """{head_dim: [[tokens, FLOP/s]]} of a causal prefill's attention as the engine calls it: 8 query
    heads on 4 KV heads (GQA), [tokens, heads, d] views, torch's SDPA. The rate depends on the head
    size (a head of 32 has half the arithmetic per byte of one of 64). `causal=False`: a square
    block with no mask, as a cp ring attends another rank's keys (FLOPs: every pair, not half)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    out: dict[str, list[list[float]]] = {}
    for d in head_dims:
        out[str(d)] = []
        for t_len in lengths:
            q = torch.randn(1, t_len, heads, d)
            k, v = torch.randn(1, t_len, heads // 2, d), torch.randn(1, t_len, heads // 2, d)
            t = _best_time(
                lambda: F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=True
                )
            )
            pairs = t_len * (t_len + 1) / 2 if causal else t_len * t_len
            out[str(d)].append([t_len, 4.0 * d * heads * pairs / t])
    return out


def measure_bandwidth(
    threads: int, mib: int = 256, row_lengths=STREAM_ROW_LENGTHS, placements: int = 5, samples: Optional[dict] = None
) -> tuple[list[list[float]], str]:
    """([[row length, bytes/s]], what read them): weights far larger than the caches streamed through
    4-row products, as a decode step reads them, with the engine's native skinny kernel when it
    builds here (what decode uses by default), else torch's. The weights are 16 matrices of rows of
    each length, as a model's layers are: the rate depends on the row length (long rows stream
    slower; a calibrated profile's table, e.g. docs/profiles/cpu2-vm.json), not on how the bytes are
    split. Each rate is the median over `placements` fresh allocations timed one after the other: on a
    shared VM two threads stream faster in some spells than in others (the vCPUs' placement on the
    host, likely; docs/benchmarks.md, "Choosing the layout: the cost model against measurements"),
    and one allocation's timing can fall in a short spell. `samples` ({row length: [rates]}, given):
    this call's rates join those of earlier calls, and the medians are over all of them
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

            def run(ws=ws, x=x):
                for w in ws:
                    product(x, w)

            rates.append(sum(w.numel() for w in ws) * 4 / _sustained_time(run, min_s=0.3, warm_s=warm))
            warm = 0.0
            del ws
        out.append([k, statistics.median(rates)])
    return out, "the native skinny kernel" if kernels is not None else "torch F.linear"


DECODE_KV_HEADS = (1, 2, 3, 4, 6, 8)  # KV heads on a rank (each with two query heads)
DECODE_CONTEXTS = (1024, 4096, 8192, 16384)  # tokens of one sequence's cache on a rank


def measure_decode_attention(
    threads: int,
    contexts=DECODE_CONTEXTS,
    mib: int = 160,
    head_dims=ATTENTION_HEAD_DIMS,
    kv_heads=DECODE_KV_HEADS,
    placements: int = 3,
    min_s: float = 0.2,
    reps: int = 3,
) -> dict:
    """{head_dim: {kv_heads: [[context, KV bytes/s]]}} the native paged decode attention reads: one
    query, `kv_heads` KV heads with two query heads each, over caches cycled through `mib` MiB so
    that they come from memory, as a model's layers' do, not from the CPU's caches (a few copies of
    a short context fit in an L3 and read faster). The rate depends on the head size, the KV heads
    and the context: the kernel splits the keys in chunks shared by the threads, and a short context
    has few chunks and pays the merge (docs/benchmarks.md, "Decode attention at long contexts: the
    chunked kernel"; an older kernel that read one KV head at a time slowed with more heads and
    longer contexts). The caches lie in `placements` separate buffers of `mib` MiB, each pass reading
    all of them (with one buffer each, the same read moved widely between two processes minutes
    apart). Each point is the best of `reps` timings of at least `min_s` seconds.
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
                caches = [
                    (
                        pool[i * 2 * one : (i * 2 + 1) * one].view(nb, bs, kv, d),
                        pool[(i * 2 + 1) * one : (i * 2 + 2) * one].view(nb, bs, kv, d),
                    )
                    for pool in pools
                    for i in range(pool.numel() // (2 * one))
                ]
                if not caches:
                    raise ValueError(
                        f"calibrate: a {context}-token cache of {kv} heads of {d} does not fit in {mib} MiB"
                    )
                q = torch.randn(1, 2 * kv * d)

                def run():
                    for kc, vc in caches:
                        kernels.decode_attention(q, kc, vc, tables, lens, None, 0.1)

                t = _sustained_time(run, min_s=min_s, warm_s=warm, reps=reps)
                warm = 0.0
                out[str(d)][str(kv)].append([context, len(caches) * context * kv * d * 4 * 2 / t])
    return out


STREAM_SIZES_MIB = (0.25, 1, 4, 16)  # weight matrices' sizes (16 MiB: what measure_bandwidth streams)


def measure_size_factor(threads: int, mib: int = 256, sizes=STREAM_SIZES_MIB, rounds: int = 3) -> list[list[float]]:
    """[[matrix bytes, factor]]: how fast 4-row products stream matrices of each size (rows of 1024
    floats, cycled through `mib` MiB so that every one comes from memory) against the largest. A
    model's matrices are small (SmolLM2's 1-7 MiB) and each pays its call, the wake of the other
    threads and the prefetchers' start, so the smaller a matrix the slower it streams (a calibrated
    profile's factors, e.g. docs/profiles/cpu2-vm.json). Each factor is the median over `rounds`
    rounds of every size, each against its own round's largest: a ratio of two timings seconds apart
    moves with a shared VM's memory spells (one calibrate once read one size far below the others)."""
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
            ws = [pool[i * n * k : (i + 1) * n * k].view(n, k) for i in range(pool.numel() // (n * k))]

            def run():
                for w in ws:
                    kernels.skinny_linear(x, w)

            t = _sustained_time(run, min_s=0.3, warm_s=warm)
            warm = 0.0
            rates.append((n * k * 4.0, len(ws) * n * k * 4.0 / t))
        for nbytes, rate in rates:
            factors.setdefault(nbytes, []).append(rate / rates[-1][1])
    return [[nbytes, statistics.median(f)] for nbytes, f in factors.items()]


REFERENCE_ROWS, REFERENCE_ROW_LENGTH = 256, 1024  # a prefill's GEMM, a decode's weight streaming


def measure_reference(threads: int) -> dict:
    """The machine's speed right now in about a second: the GEMM rate for a prefill's rows and the
    rate weights stream at, with `threads` threads. calibrate stores it in the profile; `bench
    --sweep` takes it again before each layout: on a shared VM the same microbenchmarks move widely
    within minutes (a noisy neighbour; docs/benchmarks.md, "Choosing the layout: the cost model
    against measurements"), and a prediction is for the machine as it is."""
    gemm = measure_gemm(threads, (REFERENCE_ROWS,))[0][1]
    stream = measure_bandwidth(threads, 256, (REFERENCE_ROW_LENGTH,))[0][0][1]
    return {"threads": threads, "gemm_flops": gemm, "stream_bandwidth": stream}

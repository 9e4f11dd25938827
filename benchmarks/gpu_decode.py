"""The GPU decode step with and without CUDA graphs on one loaded model, beside its HBM floor.

For each batch: the same greedy generation with --cuda-graphs off (eager steps, the same kernels)
and on (captured buckets); the ids must be identical, and the decode rates are reported. The
floor is what one step must read (every weight but the embedding's unused rows, plus the batch's
KV) over the device-to-device copy bandwidth measured here (bytes read and written). One JSON
line per batch, then a summary line (docs/benchmarks.md, "The GPU decode step").

    python benchmarks/gpu_decode.py --model DIR [--batches 1,8,32] [--prompt-len 512] [--gen-len 128]

--deterministic: cuBLAS and torch in their deterministic modes, so that graphs and eager steps can be
held to identical ids on random weights (near ties everywhere; transformers' own ids change between
repeats otherwise). --profile: the kernels of one replay of each batch's graph, by device time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--deterministic" in sys.argv:  # before cuBLAS starts
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"

import torch


def copy_bandwidth(gib: float = 1.0, iters: int = 20) -> float:
    """Device-to-device copy rate, bytes read plus written per second (median of `iters`)."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n * 2 / times[len(times) // 2]


def step_bytes(stage, batch: int, context: int) -> int:
    """What one decode step must read: the weights (the embedding's B rows only) and the batch's KV."""
    cfg = stage.cfg
    weights = sum(p.numel() * p.element_size() for p in stage.parameters())
    if stage.embed_tokens is not None and not stage.tied:
        emb = stage.embed_tokens.weight
        weights -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    kv = 2 * cfg.num_layers * context * stage.kv_heads_local * cfg.head_dim * batch * stage.dtype.itemsize
    return weights + kv


def replay_ms(graph, iters: int = 50) -> float:
    """One replay's device time, replays back to back (the step with no host work between)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def replay_kernels(graph, top: int = 12) -> list:
    """[(kernel, calls, device us per replay)] of one replay, the heaviest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    rows = [(e.key[:60], e.count // 5, e.device_time_total / 5) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    return [(k, n, round(us, 1)) for k, n, us in rows[:top]] + [
        ("total", sum(r[1] for r in rows), round(sum(r[2] for r in rows), 1))
    ]


def main() -> None:
    import dist_infer
    from dist_infer.bench.peers import make_prompts
    from dist_infer.engine.engine_core import Engine, EngineConfig, WorkerOptions
    from dist_infer.engine.sampling import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    bandwidth = copy_bandwidth()
    model = dist_infer.load(args.model, device="cuda", backend="nccl", dtype=getattr(torch, args.dtype))
    stage, groups = model.engine.stage, model.engine.groups
    summary = {"copy_bandwidth_gb_s": bandwidth / 1e9, "batches": {}}
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = make_prompts(batch, args.prompt_len, stage.cfg.vocab_size).tolist()
        params = SamplingParams(max_new_tokens=args.gen_len)
        row = {"batch": batch}
        ids = {}
        for mode in ("off", "on"):
            start = time.perf_counter()
            engine = Engine(stage, groups, EngineConfig(block_size=16, worker=WorkerOptions(cuda_graphs=mode)))
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up: kernels compiled
            first = engine.generate(prompts, params)  # the cache sized for the batch (graphs captured for it)
            setup_s = time.perf_counter() - start
            outs = engine.generate(prompts, params)
            t = engine.timing.as_dict()
            ids[mode] = [o.token_ids for o in outs]
            row[f"repeat_equal_{mode}"] = ids[mode] == [o.token_ids for o in first]
            row[mode] = {
                "decode_tok_s": t["decode_tok_s"],
                "tpot_median_ms": t["tpot_median_s"] * 1e3,
                "prefill_tok_s": t["prefill_tok_s"],
                "setup_s": setup_s,
            }
            if mode == "on" and engine.worker.graphs is not None:
                graphs = engine.worker.graphs
                bucket = graphs.bucket_for(batch)
                row[mode].update(
                    capture_s=graphs.capture_s,
                    graph_mib=graphs.graph_bytes / 2**20,
                    replay_ms=replay_ms(graphs.buckets[bucket].graph),
                )
                if args.profile:
                    row["kernels"] = replay_kernels(graphs.buckets[bucket].graph)
            engine.close()
        context = args.prompt_len + args.gen_len // 2
        floor_ms = step_bytes(stage, batch, context) / bandwidth * 1e3
        row.update(
            ids_equal=ids["off"] == ids["on"],
            hbm_floor_ms=floor_ms,
            speedup=row["on"]["decode_tok_s"] / row["off"]["decode_tok_s"],
            step_over_floor=row["on"]["tpot_median_ms"] / floor_ms,
        )
        summary["batches"][batch] = row
        print(json.dumps(row), flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

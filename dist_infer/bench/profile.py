"""`bench --profile`: where one rank's time goes, by kind of work.

The workload runs once more under the torch profiler. Every outermost op falls in one bucket
(GEMM, attention, communication, other tensor ops); what the ops do not account for is
Python and framework overhead between them. Prefill (the first step) and decode (the
rest, reported per step) are kept apart because they are bound by different things. Under cp,
the prefill's ring is also split per step (post, attend, merge, wait), summed over the layers.
"""

from __future__ import annotations

import json
import os
from typing import Optional

# the native products too, and the decode stack's calls: whole layers, but mostly their products
GEMM_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "dist_infer::skinny_linear",
    "dist_infer::quant_linear",
    "dist_infer::dequantize_rows",
    "dist_infer::decode_stack",
    "dist_infer::decode_layer_part",
)
ATTENTION_OPS = (
    "aten::_scaled_dot_product",
    "aten::scaled_dot_product",
    "dist_infer::decode_attention",
    "dist_infer::rope_cache_write",
)
MARK = "dist_infer::generate"
RING = "dist_infer::ring::step"  # the ranges parallel/ring/ring_loops.py opens per ring step and part
COMM_MARKERS = (
    "gloo",
    "nccl",
    "mpi",
    "all_reduce",
    "allreduce",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "send",
    "recv",
    "alltoall",
    "all_to_all",
    "barrier",
    "c10d",
    "dist_infer::comm",
)


def op_bucket(name: str) -> str:
    """The kind of work an op's name says it is: gemm, attention, comm or other."""
    lower = name.lower()
    if name.startswith(GEMM_OPS):
        return "gemm"
    if name.startswith(ATTENTION_OPS):
        return "attention"
    if any(m in lower for m in COMM_MARKERS):
        return "comm"
    return "other"


def _through_ring_ranges(events):
    """The ops, with each ring-step range replaced by what it holds (a range is not a kind of work)."""
    for e in events:
        if e.name.startswith(RING):
            yield from _through_ring_ranges(e.cpu_children)
        else:
            yield e


def ring_steps(events, start_us: float, end_us: float) -> dict:
    """Seconds per ring step and part in [start_us, end_us), summed over layers: {step: {post,
    attend, merge, wait}}. 'attend' is the block attention (the kernel and its layout copies),
    'merge' the LSE merge into the accumulators, 'post' posting the next step's send/recv,
    'wait' what that transfer leaves exposed after the step's compute."""
    out: dict = {}
    for e in events:
        if e.name.startswith(RING) and start_us <= e.time_range.start < end_us:
            step, part = e.name[len(RING) :].split(".", 1)
            parts = out.setdefault(int(step), {"post": 0.0, "attend": 0.0, "merge": 0.0, "wait": 0.0})
            parts[part] += e.cpu_time_total / 1e6
    return dict(sorted(out.items()))


def split_buckets(events, start_us: float, end_us: float) -> dict:
    """Seconds per bucket of the outermost ops that start in [start_us, end_us). Each counts
    whole (its children included: a communication range holds the copies it makes, SDPA its
    bmm); 'python' is what the ops leave of the wall time."""
    out = {"gemm": 0.0, "attention": 0.0, "comm": 0.0, "other": 0.0}
    for e in events:
        if start_us <= e.time_range.start < end_us:
            out[op_bucket(e.name)] += e.cpu_time_total / 1e6
    wall = (end_us - start_us) / 1e6
    out["python"] = max(0.0, wall - sum(out.values()))
    out["wall"] = wall
    return out


def profile_generation(engine, prompts, gen_len: int, directory: str, rank: int) -> dict:
    """One generation of `prompts` under the profiler; writes DIR/rank<N>.txt (the op table) and
    DIR/rank<N>.json (the result); returns the buckets of the prefill and of one decode step (the
    mean of the decode steps), and a cp prefill's time per ring step and part."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from dist_infer.engine.sampling import SamplingParams

    os.makedirs(directory, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(MARK):
            engine.generate(prompts, SamplingParams(max_new_tokens=gen_len, stop_at_eos=False))
    events = prof.events()
    mark = next(e for e in events if e.name == MARK)
    top = list(_through_ring_ranges(e for e in events if e.cpu_parent is not None and e.cpu_parent.name == MARK))
    start, end = mark.time_range.start, mark.time_range.end
    first_token = start + engine.timing.ttft_s * 1e6  # the engine's clock starts just inside the mark
    steps = max(1, gen_len - 1)
    decode = {k: v / steps for k, v in split_buckets(top, first_token, end).items()}
    with open(os.path.join(directory, f"rank{rank}.txt"), "w") as f:
        f.write(f"# rank {rank}: prefill then {steps} decode steps; CPU time per op\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
    result = {
        "prefill_s": split_buckets(top, start, first_token),
        "decode_step_s": decode,
        "prefill_ring_steps_s": ring_steps(events, start, first_token),
        "table": os.path.join(directory, f"rank{rank}.txt"),
    }
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:  # every rank's, not only the one printed
        json.dump(result, f, indent=1)
    return result


def format_profile(p: dict, rank: Optional[int] = 0) -> str:
    def line(label: str, d: dict, unit: float) -> str:
        parts = [f"{k} {d[k] * unit:.1f}" for k in ("gemm", "attention", "comm", "other", "python")]
        return f"{label} (ms): " + ", ".join(parts) + f" = {d['wall'] * unit:.1f}"

    lines = [
        f"profile of rank {rank}, self time per kind of work (table: {p['table']})",
        line("  prefill", p["prefill_s"], 1e3),
        line("  decode step", p["decode_step_s"], 1e3),
    ]
    for step, parts in p.get("prefill_ring_steps_s", {}).items():
        lines.append(
            f"  prefill ring step {step} (ms, all layers): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items())
        )
    return "\n".join(lines)

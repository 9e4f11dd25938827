"""`bench --profile`: where one rank's time goes, by kind of work.

The workload runs once more under the torch profiler. Every outermost op falls in one bucket
(GEMM, attention, communication, other tensor ops); what the ops do not account for is
Python and framework overhead between them. Prefill (the first step) and decode (the
rest, reported per step) are kept apart because they are bound by different things.
"""

from __future__ import annotations

import os
from typing import Optional

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
            "dist_infer::skinny_linear")
ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::scaled_dot_product", "dist_infer::decode_attention",
                 "dist_infer::rope_cache_write")
MARK = "dist_infer::generate"
COMM_MARKERS = ("gloo", "nccl", "mpi", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                "broadcast", "send", "recv", "alltoall", "all_to_all", "barrier", "c10d", "dist_infer::comm")


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
    """One generation of `prompts` under the profiler; writes DIR/rank<N>.txt, returns the buckets
    of the prefill and of one decode step (the mean of the decode steps)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from dist_infer.engine.sampling import SamplingParams

    os.makedirs(directory, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(MARK):
            engine.generate(prompts, SamplingParams(max_new_tokens=gen_len, stop_at_eos=False))
    events = prof.events()
    mark = next(e for e in events if e.name == MARK)
    top = [e for e in events if e.cpu_parent is not None and e.cpu_parent.name == MARK]
    start, end = mark.time_range.start, mark.time_range.end
    first_token = start + engine.timing.ttft_s * 1e6  # the engine's clock starts just inside the mark
    steps = max(1, gen_len - 1)
    decode = {k: v / steps for k, v in split_buckets(top, first_token, end).items()}
    with open(os.path.join(directory, f"rank{rank}.txt"), "w") as f:
        f.write(f"# rank {rank}: prefill then {steps} decode steps; CPU time per op\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
    return {"prefill_s": split_buckets(top, start, first_token), "decode_step_s": decode,
            "table": os.path.join(directory, f"rank{rank}.txt")}


def format_profile(p: dict, rank: Optional[int] = 0) -> str:
    def line(label: str, d: dict, unit: float) -> str:
        parts = [f"{k} {d[k] * unit:.1f}" for k in ("gemm", "attention", "comm", "other", "python")]
        return f"{label} (ms): " + ", ".join(parts) + f" = {d['wall'] * unit:.1f}"

    return "\n".join([f"profile of rank {rank}, self time per kind of work (table: {p['table']})",
                      line("  prefill", p["prefill_s"], 1e3), line("  decode step", p["decode_step_s"], 1e3)])

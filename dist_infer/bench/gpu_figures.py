"""Two figures the planner lacks, measured on a GPU (`make gpu-check` runs this after the tests).

    python -m dist_infer.bench.gpu_figures [--json]

1. The FP8 GEMM rate at 8,192 rows of Llama-3-405B's feed-forward shapes (hidden 16,384, FFN
   53,248), whole and per tp=8 shard, beside bf16 on the same shapes: what `plan --mlp-dtype fp8`
   assumes (planner/hardware.py).
2. The fixed cost of one pass-KV ring step on this GPU: a step's local work on blocks so small
   that only the fixed cost is left (the attention call with its log-sum-exp, and the LSE merge),
   the planner's `cp_step_s` less the link's latency (which needs two GPUs to measure).
Each figure is the median of timed repeats after a warm-up, with CUDA events.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

HIDDEN, FFN, ROWS, TP = 16_384, 53_248, 8_192, 8


def _time_cuda(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds of `fn()` on the current stream."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gemm_rates(rows: int = ROWS) -> list[dict]:
    """TFLOP/s of [rows, k] x [k, n] in FP8 (e4m3, per-tensor scales, bf16 out) and in bf16."""
    import torch

    shapes = {
        "up+gate whole": (HIDDEN, 2 * FFN),
        "down whole": (FFN, HIDDEN),
        f"up+gate tp={TP}": (HIDDEN, 2 * FFN // TP),
        f"down tp={TP}": (FFN // TP, HIDDEN),
    }
    one = torch.ones((), device="cuda", dtype=torch.float32)
    out = []
    for name, (k, n) in shapes.items():
        a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        flops = 2.0 * rows * k * n
        fp8 = _time_cuda(lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        bf16 = _time_cuda(lambda: a @ w.t())
        out.append(
            {
                "shape": name,
                "m": rows,
                "k": k,
                "n": n,
                "fp8_tflops": flops / fp8 / 1e12,
                "bf16_tflops": flops / bf16 / 1e12,
                "fp8_over_bf16": bf16 / fp8,
            }
        )
    return out


def ring_step_local_cost(heads: int = 8, kv_heads: int = 8, head_dim: int = 128, tokens: int = 16) -> dict:
    """Seconds of one ring step's local work on tiny blocks: the block attention with its LSE, and
    merging it into the running output (per layer; the link's latency is added by the planner)."""
    import torch

    from dist_infer.parallel.ring.local_attention import attention_with_lse
    from dist_infer.parallel.ring.lse import merge_into

    q = torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    acc_o, acc_lse = attention_with_lse(q, k, v, causal=True)
    acc_o = acc_o.float()

    def step():
        o, lse = attention_with_lse(q, k, v, causal=False)
        merge_into(acc_o, acc_lse, o.float(), lse)

    attend = _time_cuda(lambda: attention_with_lse(q, k, v, causal=False), repeats=200, warmup=20)
    whole = _time_cuda(step, repeats=200, warmup=20)
    return {"tokens": tokens, "heads": heads, "head_dim": head_dim, "attention_s": attend, "step_local_s": whole}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dist_infer.bench.gpu_figures", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--rows", type=int, default=ROWS, help="GEMM rows (tokens of a prefill step; default %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_figures: no CUDA device visible to torch; nothing measured", file=sys.stderr)
        return 0
    figures = {
        "device": torch.cuda.get_device_name(),
        "gemm": gemm_rates(args.rows),
        "ring_step": ring_step_local_cost(),
    }
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"{figures['device']}: GEMMs at {args.rows} rows (Llama-3-405B feed-forward)")
    for g in figures["gemm"]:
        print(
            f"  {g['shape']:>16} [{g['m']}x{g['k']}]x[{g['k']}x{g['n']}]: fp8 {g['fp8_tflops']:7.1f} TFLOP/s, "
            f"bf16 {g['bf16_tflops']:7.1f} TFLOP/s ({g['fp8_over_bf16']:.2f}x)"
        )
    r = figures["ring_step"]
    print(
        f"  one pass-KV ring step's local fixed cost: {r['step_local_s'] * 1e6:.1f} us "
        f"(attention with LSE {r['attention_s'] * 1e6:.1f} us)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

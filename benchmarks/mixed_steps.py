"""What a prompt costs when it is cut into chunks beside running decodes, with a step's layers in one
native call (`--native-kernels on`: models/fused_decode.py, BLAS past 8 rows) against one layer and
one kernel at a time (`layers`), on one rank, alternating the two in each round. The source of the
"Mixed steps in one native call" table in docs/benchmarks.md.

For each chunk size C: D sequences decode (256-token contexts) while a P-token prompt arrives and is
computed C tokens a step beside them; reported are the steps it took, their total and median (the
gap the decodes see), and the decode-only step before it. Then the same prompt alone, in one step,
and with --long-prompt N an N-token prompt alone in 256-token chunks (attention over long context).

    python benchmarks/mixed_steps.py [--model default] [--chunks 16,32,64,128,256] [--rounds 2]
                                     [--long-prompt 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dist_infer.comm import build_groups, init_world
from dist_infer.engine.engine_core import Engine, EngineConfig
from dist_infer.engine.sampling import SamplingParams
from dist_infer.models.builtin import resolve_model
from dist_infer.models.loader import load_stage
from dist_infer.topology import Layout, Mesh


def timed_steps(engine: Engine, until) -> list[float]:
    times = []
    while not until():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def one_chunk_size(stage, groups, ids, chunk: int, decodes: int, prompt_len: int) -> dict:
    engine = Engine(
        stage, groups, EngineConfig(block_size=16, num_blocks=64 * (decodes + 2), max_batched_tokens=chunk + decodes)
    )
    for i in range(decodes):
        engine.add_request(f"d{i}", ids(256), SamplingParams(max_new_tokens=256, stop_at_eos=False))
    timed_steps(engine, lambda: sum(bool(r.output_token_ids) for r in engine.scheduler.running) >= decodes)
    decode_only = []
    for _ in range(8):
        start = time.perf_counter()
        engine.step()
        decode_only.append(time.perf_counter() - start)
    prompt = engine.add_request("p", ids(prompt_len), SamplingParams(max_new_tokens=1, stop_at_eos=False))
    mixed = timed_steps(engine, lambda: bool(prompt.output_token_ids))
    return {
        "chunk": chunk,
        "steps": len(mixed),
        "prompt_ms": 1e3 * sum(mixed),
        "mixed_step_ms": 1e3 * statistics.median(mixed),
        "decode_step_ms": 1e3 * statistics.median(decode_only),
    }


def prompt_alone(stage, groups, ids, prompt_len: int, budget: int = 4096, repeat: int = 3) -> list[float]:
    """ms of each step of a prompt computed alone, `budget` tokens a step (the fastest of `repeat`)."""
    engine = Engine(
        stage, groups, EngineConfig(block_size=16, num_blocks=prompt_len // 16 + 8, max_batched_tokens=budget)
    )
    best = None
    for i in range(repeat):
        r = engine.add_request(f"q{i}", ids(prompt_len), SamplingParams(max_new_tokens=1, stop_at_eos=False))
        times = timed_steps(engine, lambda: bool(r.output_token_ids))
        best = times if best is None or sum(times) < sum(best) else best
    return [1e3 * t for t in best]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="checkpoint directory or GGUF, or 'default' (the built-in model)")
    p.add_argument("--quantization", default="auto", help="as dist-infer's --quantization")
    p.add_argument("--chunks", default="16,32,64,128,256", help="prompt tokens a step, comma-separated")
    p.add_argument("--decodes", type=int, default=4, help="sequences decoding beside the prompt")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="rounds, each running both modes")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        help="also a prompt of this many tokens alone in 256-token chunks (attention over long context)",
    )
    p.add_argument("--json", default=None, help="write every measurement here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    world = init_world("gloo")
    groups = build_groups(world, Mesh.build(Layout(), world.size))
    stage, _ = load_stage(resolve_model(args.model), groups, torch.float32, None, quantization=args.quantization)
    gen = torch.Generator().manual_seed(0)
    vocab = stage.cfg.vocab_size

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    rows = []
    for rnd in range(args.rounds):
        for mode in ("on", "layers"):
            stage.native_decode_stack, stage.decode_stack_cache = mode == "on", None
            for chunk in (int(c) for c in args.chunks.split(",")):
                rows.append(
                    {
                        "round": rnd,
                        "mode": mode,
                        **one_chunk_size(stage, groups, ids, chunk, args.decodes, args.prompt_len),
                    }
                )
            rows.append(
                {
                    "round": rnd,
                    "mode": mode,
                    "chunk": "alone",
                    "prompt_ms": sum(prompt_alone(stage, groups, ids, args.prompt_len)),
                }
            )
            if args.long_prompt:
                steps = prompt_alone(stage, groups, ids, args.long_prompt, budget=256, repeat=1)
                rows.append(
                    {
                        "round": rnd,
                        "mode": mode,
                        "chunk": f"{args.long_prompt} in 256s",
                        "steps": len(steps),
                        "prompt_ms": sum(steps),
                        "mixed_step_ms": steps[-1],
                        "decode_step_ms": float("nan"),
                    }
                )
    print(
        f"| mode | chunk | steps | prompt total ms | mixed step ms (median) | decode-only step ms |  "
        f"({torch.get_num_threads()} threads, {args.decodes} decodes, {args.prompt_len}-token prompt)"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["chunk"] == "alone":
            print(f"| {r['mode']} (round {r['round']}) | alone | 1 | {r['prompt_ms']:.0f} | | |")
        elif isinstance(r["chunk"], str):  # the long prompt: its last chunk attends to the most context
            print(
                f"| {r['mode']} (round {r['round']}) | {r['chunk']} | {r['steps']} | {r['prompt_ms']:.0f} | "
                f"last {r['mixed_step_ms']:.1f} | |"
            )
        else:
            print(
                f"| {r['mode']} (round {r['round']}) | {r['chunk']} | {r['steps']} | {r['prompt_ms']:.0f} | "
                f"{r['mixed_step_ms']:.1f} | {r['decode_step_ms']:.1f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A step of N prompt tokens alone, timed in one process (one thread by default; the default model).

    python benchmarks/prompt_step_sizes.py [--sizes 1,8,16,...] [--threads 1] [--repeat 5]

Shows where the decode stack leaves its skinny kernels (up to MAX_ROWS rows, on the quantized weights)
for the GEMM on dequantized panels, whose cost every step of more rows pays once whatever its size
(docs/benchmarks.md, "Mixed steps in one native call"). Fresh random prompts: no prefix-cache hits.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from dist_infer.engine.api import load
from dist_infer.engine.sampling import SamplingParams
from dist_infer.models.builtin import resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a checkpoint or GGUF, or 'default' (the built-in model)")
    p.add_argument(
        "--sizes", default="1,8,16,24,32,64,128,256", help="prompt tokens of each step timed, comma-separated"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads before loading (1: one serving instance's share of a 2-core VM)",
    )
    p.add_argument("--repeat", type=int, default=5, help="steps timed per size; the median is printed")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = load(resolve_model(args.model)).engine
    rng = random.Random(0)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    prompt = [rng.randrange(100, 40000) for _ in range(max(sizes))]
    engine.generate([prompt], SamplingParams(max_new_tokens=1))  # sizes the cache for the largest step; warms up

    def prompt_step_s(n: int) -> float:
        engine.add_request(
            f"r{rng.random()}", [rng.randrange(100, 40000) for _ in range(n)], SamplingParams(max_new_tokens=1)
        )
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        while engine.has_unfinished():
            engine.step()
        return seconds

    for n in sizes:
        ms = statistics.median(prompt_step_s(n) for _ in range(args.repeat)) * 1e3
        print(f"{n:4d} prompt tokens: {ms:7.1f} ms", flush=True)


if __name__ == "__main__":
    main()

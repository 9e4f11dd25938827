"""A step of N prompt tokens alone, timed in one process on one thread (the default model).

    python benchmarks/prompt_step_sizes.py

Shows where the decode stack leaves its skinny kernels (up to MAX_ROWS rows, on the quantized weights)
for the GEMM on dequantized panels, whose cost every step of more rows pays once whatever its size
(docs/benchmarks.md, "Mixed steps in one native call"). Fresh random prompts: no prefix-cache hits.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from dist_infer.engine.api import load
from dist_infer.engine.sampling import SamplingParams
from dist_infer.models.builtin import resolve_model

SIZES = (1, 8, 16, 24, 32, 64, 128, 256)


def main() -> None:
    torch.set_num_threads(1)
    engine = load(resolve_model("default")).engine
    engine._allocate(200)
    rng = random.Random(0)

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

    prompt_step_s(32)  # warm-up: plans, buffers
    for n in SIZES:
        ms = statistics.median(prompt_step_s(n) for _ in range(5)) * 1e3
        print(f"{n:4d} prompt tokens: {ms:7.1f} ms", flush=True)


if __name__ == "__main__":
    main()

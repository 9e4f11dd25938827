"""How the step's token budget trades prefill throughput against decode stalls, on one rank:
8 running decodes (256 tokens of context each) beside a ~2040-token prompt computed in chunks of
C tokens, for several C. The source of the budget table in docs/benchmarks.md.

    python benchmarks/step_budget.py [MODEL_DIR] [THREADS]
"""

import sys
import time

import torch

from dist_infer.comm import build_groups, init_world
from dist_infer.engine.engine_core import Engine, EngineConfig
from dist_infer.engine.sampling import SamplingParams
from dist_infer.models.default_model import ensure_default_model
from dist_infer.models.loader import load_stage
from dist_infer.topology import Layout, Mesh

path = sys.argv[1] if len(sys.argv) > 1 else str(ensure_default_model())
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
world = init_world("gloo")
g = build_groups(world, Mesh.build(Layout(), world.size))
stage, _ = load_stage(path, g, torch.float32, None)
V = stage.cfg.vocab_size
for C in [64, 128, 256, 512, 1024, 2048, 4096]:
    eng = Engine(stage, g, EngineConfig(block_size=16, num_blocks=2048, max_batched_tokens=C + 8, max_num_seqs=64))
    # 8 running decodes with 256-token contexts, then one long prompt chunked at C
    for i in range(8):
        eng.add_request(
            f"d{i}", list(torch.randint(3, V, (256,)).tolist()), SamplingParams(max_new_tokens=400, stop_at_eos=False)
        )
    while (
        any(not r.output_token_ids for r in eng.scheduler.running)
        or eng.scheduler.waiting
        or not eng.scheduler.running
        or not len(eng.registry)
    ):
        eng.step()
    eng.add_request(
        "long",
        list(torch.randint(3, V, (min(8192, stage.cfg.max_positions - 8),)).tolist()),
        SamplingParams(max_new_tokens=1, stop_at_eos=False),
    )

    def timed_step() -> float:
        start = time.perf_counter()
        eng.step()
        return time.perf_counter() - start

    times = [timed_step()]
    while "long" in eng.registry:
        times.append(timed_step())
    pure = [timed_step() for _ in range(5)]
    n = min(8192, stage.cfg.max_positions - 8)
    print(
        f"chunk {C:5d}: mixed step median {sorted(times)[len(times) // 2] * 1e3:7.1f} ms, prefill {n / sum(times):7.0f} tok/s, decode-only step {sorted(pure)[2] * 1e3:6.1f} ms",
        flush=True,
    )

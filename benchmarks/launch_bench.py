"""Wall time of a whole small `dist-infer generate --nproc N` job (start, load, 4 tokens, exit),
two checkouts side by side, alternating, 5 runs each: what every local job pays before and after
its work (the launcher without torch, the ranks without the interpreter's teardown; docs/benchmarks.md,
"What a local job pays to start and end").

    python benchmarks/launch_bench.py OLD_CHECKOUT NEW_CHECKOUT MODEL_DIR
(MODEL_DIR: any small HF Llama checkpoint, e.g. tests/support/checkpoints.py's llama-gqa.)"""

import os
import statistics
import subprocess
import sys
import time


def main(old: str, new: str, model: str) -> None:
    res: dict = {}
    for _ in range(5):
        for name, path in (("before", old), ("after", new)):
            for n in (1, 2, 4):
                env = dict(os.environ, PYTHONPATH=os.path.abspath(path))  # children inherit it: the same code
                t = time.perf_counter()
                p = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "dist_infer",
                        "generate",
                        "--model",
                        model,
                        "--tp",
                        str(n),
                        "--nproc",
                        str(n),
                        "--max-new-tokens",
                        "4",
                        "--prompt-ids",
                        "1,2,3",
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    cwd="/tmp",
                )
                if p.returncode != 0:
                    raise SystemExit(f"{name} tp={n} failed: {p.stderr[-1000:]}")
                res.setdefault((n, name), []).append(time.perf_counter() - t)
    for (n, name), v in sorted(res.items(), key=lambda kv: (kv[0][0], kv[0][1] != "before")):
        print(
            f"tp={n} {name:7}: min {min(v):.2f} s, median {statistics.median(v):.2f} s ({', '.join(f'{x:.2f}' for x in v)})"
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""Wall and CPU time of a whole small `dist-infer generate --nproc N` job (start, load, 4 tokens,
exit), two variants side by side, alternating, 5 runs each: what every local job pays before and
after its work (docs/benchmarks.md, "What a local job pays to start and end").

    python benchmarks/launch_bench.py MODEL_DIR                          # ranks exec'd vs forked, this checkout
    python benchmarks/launch_bench.py MODEL_DIR OLD_CHECKOUT NEW_CHECKOUT  # two checkouts

(MODEL_DIR: any small HF Llama checkpoint, e.g. tests/support/checkpoints.py's llama-gqa.)
CPU time is the job's processes' user + system time, as the parent sees its reaped children."""

import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _one_job(model: str, n: int, env: dict) -> tuple[float, float]:
    """(wall s, CPU s) of one job."""
    argv = [sys.executable, "-m", "dist_infer", "generate", "--model", model, "--tp", str(n), "--nproc", str(n)]
    argv += ["--max-new-tokens", "4", "--prompt-ids", "1,2,3"]
    cpu, t = _children_cpu(), time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, cwd="/tmp")
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"tp={n} failed: {p.stderr[-1000:]}")
    return wall, _children_cpu() - cpu


def main(model: str, old: str = "", new: str = "") -> None:
    if old:
        variants = {"before": {"PYTHONPATH": os.path.abspath(old)}, "after": {"PYTHONPATH": os.path.abspath(new)}}
    else:
        variants = {name: {"PYTHONPATH": REPO, "DIST_INFER_RANK_START": name} for name in ("exec", "fork")}
    res: dict = {}
    for _ in range(5):
        for name, extra in variants.items():
            for n in (1, 2, 4):  # the children inherit PYTHONPATH: the same code in every process
                res.setdefault((n, name), []).append(_one_job(model, n, dict(os.environ, **extra)))
    for n in (1, 2, 4):
        for name in variants:
            walls, cpus = zip(*res[(n, name)])
            print(
                f"tp={n} {name:6}: wall min {min(walls):.2f} s, median {statistics.median(walls):.2f} s; "
                f"CPU median {statistics.median(cpus):.2f} s ({', '.join(f'{x:.2f}' for x in walls)})"
            )


if __name__ == "__main__":
    main(*sys.argv[1:4])

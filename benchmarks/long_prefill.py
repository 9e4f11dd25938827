"""Long-prompt prefill, side by side: ours with cp=2 and in one process, HF transformers (sdpa, one
process) and DeepSpeed-Inference (AutoTP on 2 ranks, or 1 rank), at growing prompt lengths on the same model,
until each runs out of memory (or of the time allowed). Records prefill time and peak memory per
rank, writes the results as JSON and draws both against prompt length (log axes).

    python benchmarks/long_prefill.py --model DIR --lengths 16384,65536,262144,1048576 \
        --systems cp2,one,hf,deepspeed,deepspeed-1 --out docs/long_prefill.json --plot docs/long_prefill.png

Each run is one process tree under `prlimit --as` (the machine's memory cap split over its
ranks), so running out of memory is an allocation error in that run, not the kernel's OOM
killer picking a process. A system that fails or times out at one length is not tried at longer
ones. `--merge FILE` adds earlier results (a run at 1M takes minutes). Check `uptime` before and
after: a figure counts only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
LABELS = {
    "cp2": "ours, cp=2 (2 ranks)",
    "one": "ours, one process",
    "hf": "HF transformers (sdpa)",
    "deepspeed": "DeepSpeed AutoTP tp=2",
    "deepspeed-1": "DeepSpeed-Inference, 1 rank",
}
RANKS = {"cp2": 2, "one": 1, "hf": 1, "deepspeed": 2, "deepspeed-1": 1}


def _loadavg() -> float:
    return os.getloadavg()[0]


def _prompt_file(work: Path, length: int, vocab: int) -> Path:
    path = work / f"prompt_{length}.txt"
    if not path.exists():
        rng = random.Random(length)
        path.write_text(",".join(str(rng.randrange(3, vocab)) for _ in range(length)))
    return path


def _command(system: str, model: str, length: int, prompt: Path, out_json: Path, timeout: float) -> list[str]:
    if system in ("cp2", "one"):
        flags = ["--cp", "2"] if system == "cp2" else ["--nproc", "1"]
        return [
            str(BIN / "dist-infer"),
            "generate",
            "--model",
            model,
            "--prompt-ids",
            f"@{prompt}",
            "--max-new-tokens",
            "2",
            "--no-eos-stop",
            "--json",
            "--timeout",
            str(timeout),
            *flags,
        ]
    peer = [
        "-m",
        "dist_infer.bench.peers",
        "--peer",
        system.split("-")[0],
        "--model",
        model,
        "--batch",
        "1",
        "--prompt-len",
        str(length),
        "--gen-len",
        "2",
        "--json-out",
        str(out_json),
        "--timeout",
        str(timeout),
    ]
    if system == "hf":
        return [sys.executable, *peer]
    return [
        str(BIN / "torchrun"),
        "--nproc-per-node",
        str(RANKS[system]),
        "--master-port",
        str(29700 + length % 200),
        *peer,
    ]


def _parse(system: str, proc: subprocess.CompletedProcess, out_json: Path) -> dict:
    if system in ("cp2", "one"):
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            return {"ok": False, "error": proc.stderr[-600:]}
        out = json.loads(lines[-1])
        return {
            "ok": True,
            "prefill_s": out["timing"]["ttft_s"],
            "peak_rss_mb_per_rank": out["memory"]["peak_rss_mb_per_rank"],
            "token_ids": out["outputs"][0]["token_ids"],
        }
    if not out_json.exists():
        return {"ok": False, "error": proc.stderr[-600:]}
    m = json.loads(out_json.read_text())
    if not m.get("ok"):
        return {"ok": False, "error": m.get("error") or proc.stderr[-600:]}
    return {
        "ok": True,
        "prefill_s": m["ttft_s"],
        "peak_rss_mb_per_rank": [m["peak_rss_mb"]] * RANKS[system],
        "token_ids": m["token_ids"][0],
    }


def run_one(system: str, model: str, length: int, work: Path, mem_cap_gib: float, timeout: float) -> dict:
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompt = _prompt_file(work, length, vocab)
    out_json = work / f"{system}_{length}.json"
    out_json.unlink(missing_ok=True)
    cap = int(mem_cap_gib * 2**30 / RANKS[system])
    cmd = ["prlimit", f"--as={cap}", *_command(system, model, length, prompt, out_json, timeout)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", CUDA_VISIBLE_DEVICES="")
    before, t0 = _loadavg(), time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        result = _parse(system, proc, out_json)
    except subprocess.TimeoutExpired:
        result = {"ok": False, "error": f"not done within {timeout:.0f} s"}
    result.update(
        system=system,
        prompt_len=length,
        wall_s=time.perf_counter() - t0,
        loadavg_1m=[before, _loadavg()],
        mem_cap_gib_per_rank=cap / 2**30,
    )
    if not result["ok"]:
        text = result["error"]
        result["out_of_memory"] = any(
            s in text
            for s in ("can't allocate memory", "CPUAllocator", "MemoryError", "Cannot allocate memory", "out of memory")
        )
    return result


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in LABELS:
        done = sorted((r for r in results if r["system"] == system and r["ok"]), key=lambda r: r["prompt_len"])
        if not done:
            continue
        xs = [r["prompt_len"] for r in done]
        line = ax_t.plot(xs, [r["prefill_s"] for r in done], "o-", label=LABELS[system])[0]
        ax_m.plot(
            xs,
            [max(r["peak_rss_mb_per_rank"]) / 1024 for r in done],
            "o-",
            color=line.get_color(),
            label=LABELS[system],
        )
        failed = [r for r in results if r["system"] == system and not r["ok"]]
        for r in failed:
            why = "out of memory" if r.get("out_of_memory") else "timed out" if "within" in r["error"] else "failed"
            ax_t.plot([r["prompt_len"]], [done[-1]["prefill_s"]], "x", color=line.get_color(), ms=10)
            ax_t.annotate(why, (r["prompt_len"], done[-1]["prefill_s"]), fontsize=7, color=line.get_color())
    for ax, label in ((ax_t, "prefill time (s)"), (ax_m, "peak memory per rank (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle("Long-prompt prefill on 2 CPU cores (x: a run that failed, drawn at the last time reached)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory (a tiny long-context Llama)")
    p.add_argument("--lengths", default="16384,65536,262144,1048576", help="prompt lengths, comma separated")
    p.add_argument("--systems", default="cp2,one,hf,deepspeed", help=f"any of {','.join(LABELS)}")
    p.add_argument("--mem-cap-gib", type=float, default=20.0, help="address-space cap of a run, split over its ranks")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--out", required=True, help="results JSON (one record per system and length)")
    p.add_argument(
        "--merge", default=None, help="earlier results JSON to keep (the same system and length is replaced)"
    )
    p.add_argument("--plot", default=None, help="PNG: prefill time and peak memory vs prompt length")
    p.add_argument("--no-run", action="store_true", help="run nothing: write --merge's results to --out and plot them")
    args = p.parse_args(argv)
    results = json.loads(Path(args.merge).read_text()) if args.merge else []
    work = Path(tempfile.mkdtemp(prefix="long_prefill_"))
    for system in [] if args.no_run else args.systems.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            r = run_one(system, args.model, length, work, args.mem_cap_gib, args.timeout)
            results = [x for x in results if (x["system"], x["prompt_len"]) != (system, length)] + [r]
            print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
            if not r["ok"]:
                break
    Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The SLO autoscaler against a fixed fleet on the same bursty trace (docs/benchmarks.md, "The SLO autoscaler").

Two servers of the same model, one after the other (alternating over rounds): `--autoscale 1:2
--slo ttft=T,tpot=P` (starts with one instance) and a fixed `--instances tp1,tp1`. Each instance
gets the same cores in both (half the machine: the autoscaled server sizes each instance for its
largest fleet). The same trace runs against each: phases of `bench-serve` runs (gamma arrivals,
--burstiness 0.3, fixed seeds), bursts and quiet spells in turn, and while it runs /admin/instances is sampled every 0.25 s: instance-seconds are the
time integral of the instances holding resources (serving, starting or stopping). Goodput is
bench-serve's: completed requests per second that met both SLOs. Dropped: failed requests.

    python benchmarks/autoscale.py [--rounds 2] [--phases 1.5x60,0.1x8,1.5x60,0.1x8] [--out FILE.json]

Only 127.0.0.1 is contacted. Check `uptime` before and after: figures count on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
HOLDING = ("serving", "starting", "stopping")


def checkpoint(root: Path, hidden: int, layers: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / f"autoscale-llama-{hidden}x{layers}"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=128,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        )
        LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def serve(model: str, fleet: list[str], workdir: Path) -> tuple[subprocess.Popen, str]:
    ready = workdir / f"ready-{time.monotonic_ns()}.json"
    log = open(workdir / "serve.log", "a")
    cmd = [
        str(BIN / "dist-infer"),
        "serve",
        "--model",
        model,
        "--kv-blocks",
        "400",
        "--port",
        "0",
        "--ready-file",
        str(ready),
        *fleet,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"serve did not start; see {workdir / 'serve.log'}")
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"


def run_fleet(model: str, fleet: list[str], args, workdir: Path) -> dict:
    proc, url = serve(model, fleet, workdir)
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            insts = httpx.get(url + "/admin/instances", timeout=30).json()["instances"]
            samples.append((time.monotonic(), sum(i["state"] in HOLDING for i in insts)))
            done.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results = []
    try:
        for rate, prompts in args.phases:  # bursts and quiet spells, one bench-serve run each
            bench = subprocess.run(
                [
                    str(BIN / "dist-infer"),
                    "bench-serve",
                    "--url",
                    url,
                    "--num-prompts",
                    str(prompts),
                    "--request-rate",
                    str(rate),
                    "--burstiness",
                    "0.3",
                    "--input-len",
                    str(args.input_len),
                    "--max-input-len",
                    str(3 * args.input_len // 2),
                    "--output-len",
                    "64",
                    "--prompt-ids",
                    "--vocab-size",
                    "128",
                    "--ignore-eos",
                    "--seed",
                    str(7 + len(results)),
                    "--slo",
                    f"ttft={args.ttft},tpot={args.tpot}",
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=3600,
            )
            if bench.returncode not in (0, 1):
                raise SystemExit(f"bench-serve failed: {bench.stderr[-3000:]}")
            results.append(json.loads(bench.stdout.strip().splitlines()[-1]))
    finally:
        done.set()
        sampler.join()
        admin = httpx.get(url + "/admin/instances", timeout=30).json()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    duration = sum(r["duration_s"] for r in results)
    within = sum(round(r["goodput"] * r["duration_s"]) for r in results)
    seconds = sum((t1 - t0) * n for (t0, n), (t1, _) in zip(samples, samples[1:]))
    decisions = [
        (d["action"], d["outcome"], d.get("reason")) for d in (admin.get("autoscale") or {}).get("decisions", [])
    ]
    return {
        "goodput": within / duration,
        "within_slo": within,
        "completed": sum(r["completed"] for r in results),
        "failed": sum(r.get("failed", 0) for r in results),
        "duration_s": duration,
        "instance_seconds": seconds,
        "ttft_p90_ms": [r.get("ttft_ms", {}).get("p90") for r in results],
        "decisions": decisions,
    }


def parse_phases(text: str) -> list[tuple[float, int]]:
    """'6x40,0.2x8' -> [(6.0, 40), (0.2, 8)]: (requests per second, requests) per phase."""
    return [(float(rate), int(n)) for rate, n in (part.split("x") for part in text.split(","))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--phases",
        type=parse_phases,
        default=parse_phases("1.5x60,0.1x8,1.5x60,0.1x8"),
        help="RATExREQUESTS,...: the trace's phases, bursts and quiet spells, gamma arrivals in each",
    )
    p.add_argument("--window", type=float, default=5.0, help="the autoscaler's latency window, seconds")
    p.add_argument("--down-after", type=float, default=3.0, help="--autoscale-down-after, seconds")
    p.add_argument("--ttft", type=float, default=2.0, help="TTFT SLO, seconds")
    p.add_argument("--tpot", type=float, default=0.2, help="time per output token SLO, seconds")
    p.add_argument("--hidden", type=int, default=512, help="the random Llama's width")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dist-infer-autoscale-"))
    model = checkpoint(Path(tempfile.gettempdir()), args.hidden, args.layers)
    fleets = {
        "autoscale": [
            "--autoscale",
            "1:2",
            "--slo",
            f"ttft={args.ttft},tpot={args.tpot}",
            "--autoscale-window",
            str(args.window),
            "--autoscale-cooldown",
            "5",
            "--autoscale-down-after",
            str(args.down_after),
        ],
        "fixed": ["--instances", "tp1,tp1"],
    }
    runs: dict = {name: [] for name in fleets}
    for r in range(args.rounds):
        for name in list(fleets) if r % 2 == 0 else list(reversed(fleets)):
            runs[name].append(run_fleet(model, fleets[name], args, workdir))
            print(f"round {r + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    med = {
        name: {k: statistics.median(x[k] for x in v) for k in ("goodput", "within_slo", "instance_seconds", "failed")}
        for name, v in runs.items()
    }
    ratio = {
        "goodput": med["autoscale"]["goodput"] / med["fixed"]["goodput"],
        "within_slo": med["autoscale"]["within_slo"] / med["fixed"]["within_slo"],
        "instance_seconds": med["autoscale"]["instance_seconds"] / med["fixed"]["instance_seconds"],
    }
    print(
        f"autoscale / fixed: goodput {ratio['goodput']:.2f}x, instance-seconds {ratio['instance_seconds']:.2f}x; "
        f"failed {med['autoscale']['failed']:.0f} / {med['fixed']['failed']:.0f}"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"runs": runs, "median": med, "ratio": ratio, "flags": vars(args)}, indent=1)
        )


if __name__ == "__main__":
    main()

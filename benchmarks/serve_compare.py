"""Serving benchmarks, side by side in one run: the same request stream against each server
configuration in turn (start it, wait until ready, `dist-infer bench-serve --json`, stop it),
then the ratios. Every figure in docs/benchmarks.md's serving sections comes from here.

    python benchmarks/serve_compare.py batching   # continuous vs static batching, same stream
    python benchmarks/serve_compare.py chunking   # chunked prefill on vs off: long prompts amid decodes
    python benchmarks/serve_compare.py hf         # ours vs `transformers serve` on the same model and stream
    python benchmarks/serve_compare.py migration  # 2 instances under memory pressure: rr vs load vs load + migration
    python benchmarks/serve_compare.py pd         # prefill/decode instances vs the same ranks serving mixed
    python benchmarks/serve_compare.py failover   # kill an instance under a stream: lost requests, recovery time
    python benchmarks/serve_compare.py llama-server  # ours (ITL target off / auto) vs llama.cpp's server, same GGUF
    python benchmarks/serve_compare.py vllm-cpu   # ours (fp32 / bf16 prompts) vs vLLM's CPU backend (make vllm-cpu)

Only 127.0.0.1 is ever contacted. Check `uptime` before and after: figures count on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, name: str, argv: list[str], port: int, log_dir: Path, env: dict | None = None, ready_s: float = 300
    ):
        self.name, self.port = name, port
        self.log = open(log_dir / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})}
        )
        deadline = time.monotonic() + ready_s
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} not ready after {ready_s:.0f} s; see {self.log.name}")
            time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def ours(name: str, model: str, port: int, log_dir: Path, *flags: str) -> Server:
    return Server(
        name, [str(BIN / "dist-infer"), "serve", "--model", model, "--port", str(port), *flags], port, log_dir
    )


def llama_server(binary: str, model: str, concurrency: int, context_per_slot: int, *flags: str):
    """A starter of llama.cpp's server on `model`: 2 threads, `concurrency` slots of `context_per_slot`
    tokens each, and `flags` (its speculative mode, say)."""

    def start(name: str, port: int, log_dir: Path) -> Server:
        argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2", *flags]
        return Server(
            name, argv + ["--parallel", str(concurrency), "-c", str(context_per_slot * concurrency)], port, log_dir
        )

    return start


def bench(url: str, args: list[str], out: Path) -> dict:
    cmd = [str(BIN / "dist-infer"), "bench-serve", "--url", url, "--json", "--save-results", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"bench-serve failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])


def scrape(url: str) -> dict[str, float]:
    """/metrics as name -> value, summed over labels."""
    out: dict[str, float] = {}
    r = httpx.get(url + "/metrics", timeout=30)
    if r.status_code != 200:  # a peer without Prometheus metrics (llama-server unless --metrics)
        return out
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def run_pair(configs, bench_args, log_dir: Path, after=None) -> dict:
    """Each configuration in turn: start it, bench it, scrape it, `after(name, server)` (more
    requests of the caller's own, say), stop it."""
    results = {}
    for name, start in configs:
        server = start(name, free_port(), log_dir)
        try:
            results[name] = bench(server.url, bench_args, log_dir / f"{name}.json")
            metrics = scrape(server.url)
            results[name]["preemptions"] = metrics.get("dist_infer:num_preemptions_total", 0.0)
            results[name]["migrations"] = metrics.get("dist_infer:migrations_total", 0.0)
            if after is not None:
                after(name, server)
        finally:
            server.stop()
        s = results[name]
        print(
            f"{name:>12}: {s['completed']} ok / {s['failed']} failed, {s['request_throughput']:.2f} req/s, "
            f"{s['output_throughput']:.1f} out tok/s, TTFT p50 {s['ttft_ms']['median']:.0f} p99 "
            f"{s['ttft_ms']['p99']:.0f} ms, ITL p50 {s['itl_ms']['median']:.1f} p99 {s['itl_ms']['p99']:.1f} ms, "
            f"TPOT p50 {s['tpot_ms']['median']:.1f} ms",
            flush=True,
        )
    return results


def plot(log_dir: Path, names: list[str], out: Path, title: str) -> None:
    """CDFs of TTFT and ITL for each configuration, side by side (from bench-serve's per-request records)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        records = [r for r in json.loads((log_dir / f"{name}.json").read_text())["requests"] if r["success"]]
        for ax, values in zip(axes, ([r["ttft"] for r in records], [g for r in records for g in r["itl"]])):
            v = np.sort(np.asarray(values) * 1000)
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=name)
    for ax, what in zip(axes, ("time to first token (ms)", "inter-token latency (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(what)
        ax.set_ylabel("fraction of requests" if "first" in what else "fraction of tokens")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def failover(model: str, log_dir: Path, common: list[str], args, extra: list[str]) -> dict:
    """A stream over two instances; instance 1's driver is SIGKILLed `--kill-after` s in. Its requests
    go on on instance 0: none may be lost. Then instance 1 is restarted and its time to serve again
    taken. Recovery per request: from the death to its next token (the server's histogram and log)."""
    import re
    import threading

    server = ours("failover", model, free_port(), log_dir, "--instances", "tp1,tp1", "--migrate-interval", "0", *extra)
    out: dict = {}
    stream = common + [
        "--request-rate",
        str(args.request_rate),
        "--input-len",
        "128",
        "--output-len",
        "128",
        "--prompt-ids",
        "--ignore-eos",
    ]
    try:
        runner = threading.Thread(target=lambda: out.update(bench(server.url, stream, log_dir / "failover.json")))
        runner.start()
        time.sleep(args.kill_after)
        victim = httpx.get(server.url + "/admin/instances", timeout=30).json()["instances"][1]
        held = len(victim["requests"])
        os.kill(victim["pids"][0], signal.SIGKILL)
        runner.join()
        metrics = scrape(server.url)
        started = time.monotonic()
        restart = httpx.post(server.url + "/admin/instances/1/restart", timeout=30)
        assert restart.status_code == 202, restart.text
        while httpx.get(server.url + "/admin/instances", timeout=30).json()["instances"][1]["state"] != "serving":
            time.sleep(0.05)
        restart_s = time.monotonic() - started
        log = (log_dir / "failover.log").read_text()
    finally:
        server.stop()
    seconds = sorted(float(x) / 1000 for x in re.findall(r"streams again (\d+) ms after", log))
    s = out
    result = {
        "failover": s,
        "requests_on_killed_instance": held,
        "requests_lost": metrics.get("dist_infer:requests_lost_total"),
        "failed": s["failed"],
        "recovered": len(seconds),
        "recovery_s": {
            "median": seconds[len(seconds) // 2] if seconds else None,
            "max": seconds[-1] if seconds else None,
        },
        "restart_to_serving_s": restart_s,
    }
    print(
        f"killed instance 1 holding {held} request(s): {s['completed']} completed, {s['failed']} failed, "
        f"lost {result['requests_lost']:.0f}, recovered {len(seconds)}, recovery median "
        f"{result['recovery_s']['median']} s, max {result['recovery_s']['max']} s; restarted and serving again in "
        f"{restart_s:.1f} s",
        flush=True,
    )
    return result


def vocab_size(model: str) -> int:
    if Path(model).is_dir():
        return json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    from dist_infer.models.gguf.checkpoint import GGUFCheckpoint

    with GGUFCheckpoint(model) as ckpt:
        return int(ckpt.config["vocab_size"])


def against_llama_server(model: str, log_dir: Path, args, extra: list[str]) -> dict:
    """The same GGUF and stream (256-token prompts as ids, 64 tokens out, ignore_eos) against
    llama.cpp's server (--parallel 8, 2 threads) and ours with the ITL target off (the old default)
    and auto (the new one), at each load in --loads; the ratios the ITL-target goals are stated in."""
    if not Path(model).is_file():
        raise SystemExit("llama-server: --model must be a GGUF file (default: the built-in one)")
    servers = [
        (
            "llama-server",
            lambda n, port, d: Server(
                n,
                [
                    args.llama_server,
                    "-m",
                    model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "-t",
                    "2",
                    "--parallel",
                    "8",
                    "-c",
                    "8192",
                ],
                port,
                d,
            ),
        ),
        ("ours-itl-off", lambda n, port, d: ours(n, model, port, d, "--itl-target-ms", "off", *extra)),
        ("ours-itl-auto", lambda n, port, d: ours(n, model, port, d, "--itl-target-ms", "auto", *extra)),
    ]
    results: dict = {}
    for load in args.loads.split(","):
        rate = ["--max-concurrency", load[1:]] if load.startswith("c") else ["--request-rate", load[1:]]
        stream = [
            "--num-prompts",
            str(args.num_prompts),
            "--seed",
            "1",
            "--vocab-size",
            str(vocab_size(model)),
            "--input-len",
            "256",
            "--output-len",
            "64",
            "--prompt-ids",
            "--ignore-eos",
            *rate,
        ]
        named = [(f"{name}@{load}", start) for name, start in servers]
        results[load] = run_pair(named, stream, log_dir)
        peer, off, auto = (results[load][f"{n}@{load}"] for n, _ in servers)
        results[load]["ratios"] = {
            "itl_p99_auto_over_llama": auto["itl_ms"]["p99"] / peer["itl_ms"]["p99"],
            "req_s_auto_over_llama": auto["request_throughput"] / peer["request_throughput"],
            "ttft_p50_auto_over_llama": auto["ttft_ms"]["median"] / peer["ttft_ms"]["median"],
            "throughput_auto_over_off": auto["output_throughput"] / off["output_throughput"],
            "ttft_p50_auto_over_off": auto["ttft_ms"]["median"] / off["ttft_ms"]["median"],
        }
        print(f"{load}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[load]["ratios"].items()), flush=True)
    return results


def load_stream(model: str, load: str, seed: int, num_prompts: int) -> list[str]:
    """bench-serve's flags for one load (cN: N at a time, rN: Poisson at N req/s) of 256-token id
    prompts and 64 tokens out, ignore_eos, drawn with `seed` (a fresh one per load: no prefix cache hits)."""
    rate = ["--max-concurrency", load[1:]] if load.startswith("c") else ["--request-rate", load[1:]]
    shape = ["--input-len", "256", "--output-len", "64", "--prompt-ids", "--ignore-eos"]
    return [
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--vocab-size",
        str(vocab_size(model)),
        *shape,
        *rate,
    ]


def against_vllm_cpu(model: str, log_dir: Path, args, extra: list[str]) -> dict:
    """vLLM's CPU backend (bf16, the GGUF dequantized into an HF checkpoint: benchmarks/vllm_cpu.py)
    against ours on the GGUF with fp32 prompts, with bf16 prompts (--prompt-dtype auto), and with bf16
    prompts served shortest first (--scheduling-policy shortest-prompt), the same stream at each load
    in --loads, a fresh seed per load; the ratios the goals are stated in."""
    from vllm_cpu import bf16_checkpoint, vllm_cpu_server

    if not Path(model).is_file():
        raise SystemExit("vllm-cpu: --model must be a GGUF file (default: the built-in one)")
    checkpoint = bf16_checkpoint(model, Path(args.vllm_checkpoint))
    servers = [
        ("vllm-cpu", vllm_cpu_server(Server, checkpoint, Path(args.vllm_python))),
        ("ours-fp32", lambda n, port, d: ours(n, model, port, d, "--prompt-dtype", "float32", *extra)),
        ("ours-bf16", lambda n, port, d: ours(n, model, port, d, "--prompt-dtype", "auto", *extra)),
        (  # the prompt with the fewest tokens left first (engine/prompt_order.py)
            "ours-bf16-shortest",
            lambda n, port, d: ours(
                n, model, port, d, "--prompt-dtype", "auto", "--scheduling-policy", "shortest-prompt", *extra
            ),
        ),
    ]
    servers = [s for s in servers if s[0] == "vllm-cpu" or not args.only or s[0] in args.only.split(",")]
    if args.variant:  # ours with more flags: NAME=FLAGS
        name, _, flags = args.variant.partition("=")
        servers.append(
            (name, lambda n, port, d: ours(n, model, port, d, "--prompt-dtype", "auto", *flags.split(), *extra))
        )
    results: dict = {}
    for i, load in enumerate(args.loads.split(",")):
        named = [(f"{name}@{load}", start) for name, start in servers]
        results[load] = run_pair(named, load_stream(model, load, 101 + i, args.num_prompts), log_dir)
        peer = results[load][f"vllm-cpu@{load}"]
        results[load]["ratios"] = {
            f"{key}_{name.removeprefix('ours-').replace('-', '_')}_over_vllm": stat(results[load][f"{name}@{load}"])
            / stat(peer)
            for name, _ in servers[1:]
            for key, stat in (
                ("req_s", lambda r: r["request_throughput"]),
                ("ttft_p50", lambda r: r["ttft_ms"]["median"]),
                ("itl_p99", lambda r: r["itl_ms"]["p99"]),
            )
        }
        print(f"{load}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[load]["ratios"].items()), flush=True)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "scenario", choices=("batching", "chunking", "hf", "migration", "pd", "failover", "llama-server", "vllm-cpu")
    )
    p.add_argument("--model", default="default", help="checkpoint directory, or 'default' (the built-in model)")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--flags", default="", help="extra flags for our server, e.g. '--tp 2'")
    p.add_argument("--out", default=None, help="write the combined JSON here")
    p.add_argument("--kv-blocks", type=int, default=96, help="migration: KV blocks per instance (16 tokens each)")
    p.add_argument("--bursts", type=int, default=6, help="migration: bursts of 9 requests (3 long, 6 short)")
    p.add_argument("--burst-gap", type=float, default=3.0, help="migration: seconds between bursts")
    p.add_argument("--migrate-interval", type=float, default=0.2, help="migration: the controller's interval")
    p.add_argument("--plot", default=None, help="write CDFs of TTFT and ITL per configuration to this PNG")
    p.add_argument(
        "--pd-instances",
        default="prefill:tp1,decode:tp1",
        help="pd: the disaggregated layout; the mixed one is the same without roles",
    )
    p.add_argument("--long-prompt", type=int, default=1500, help="pd: tokens of each long prompt")
    p.add_argument("--kill-after", type=float, default=3.0, help="failover: seconds into the stream to kill instance 1")
    p.add_argument(
        "--loads",
        default="c4,c8,r2",
        help="llama-server, vllm-cpu: the loads, each cN (N at a time, all queued at once) or rN (Poisson, N req/s)",
    )
    p.add_argument(
        "--vllm-python",
        default=str(Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"),
        help="vllm-cpu: the Python of the environment vllm-cpu is installed in (`make vllm-cpu`)",
    )
    p.add_argument(
        "--only", default="", help="vllm-cpu: only these of ours (comma separated names), beside vLLM and --variant"
    )
    p.add_argument(
        "--variant",
        default="",
        metavar="NAME=FLAGS",
        help="vllm-cpu: one more of ours, bf16 prompts and these flags, e.g. 'ours-itl500=--itl-target-ms 500'",
    )
    p.add_argument(
        "--vllm-checkpoint",
        default=str(Path(tempfile.gettempdir()) / "dist_infer_vllm_cpu_checkpoint"),
        help="vllm-cpu: where the GGUF's bf16 HF checkpoint is written (once; reused after)",
    )
    p.add_argument(
        "--llama-server",
        default=shutil.which("llama-server") or "llama-server",
        help="llama-server: the binary (built from llama.cpp's source; see docs/benchmarks.md)",
    )
    args = p.parse_args()
    from dist_infer.models.builtin import resolve_model

    model = resolve_model(args.model)
    log_dir = Path(tempfile.mkdtemp(prefix=f"serve-{args.scenario}-"))
    vocab = vocab_size(model)
    extra = args.flags.split()
    common = ["--num-prompts", str(args.num_prompts), "--seed", "1", "--vocab-size", str(vocab)]
    print(f"uptime before: {os.getloadavg()}; logs in {log_dir}", flush=True)
    if args.scenario == "batching":
        stream = common + [
            "--request-rate",
            str(args.request_rate),
            "--input-len",
            "128",
            "--output-len",
            "64",
            "--prompt-ids",
            "--ignore-eos",
        ]
        results = run_pair(
            [
                ("continuous", lambda n, port, d: ours(n, model, port, d, *extra)),
                (
                    "static",
                    lambda n, port, d: ours(
                        n,
                        model,
                        port,
                        d,
                        "--scheduling",
                        "static",
                        "--no-chunked-prefill",
                        "--max-batched-tokens",
                        "1000000",
                        *extra,
                    ),
                ),
            ],
            stream,
            log_dir,
        )
        c, s = results["continuous"], results["static"]
        results["ratios"] = {
            "throughput_continuous_over_static": c["output_throughput"] / s["output_throughput"],
            "ttft_p99_static_over_continuous": s["ttft_ms"]["p99"] / c["ttft_ms"]["p99"],
        }
    elif args.scenario == "chunking":
        trace = log_dir / "trace.csv"
        rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
        rows += [f"{0.25 * i:.2f},32,128" for i in range(8)]  # chats that keep decoding for a while
        rows += [f"{1.0 + 1.0 * i:.2f},2000,4" for i in range(8)]  # long prompts landing amid their decodes
        trace.write_text("\n".join(rows) + "\n")
        stream = ["--dataset", str(trace), "--prompt-ids", "--ignore-eos", "--seed", "1", "--vocab-size", str(vocab)]
        results = run_pair(
            [
                (
                    "unchunked",
                    lambda n, port, d: ours(
                        n, model, port, d, "--no-chunked-prefill", "--itl-target-ms", "off", *extra
                    ),
                ),
                ("chunked-256", lambda n, port, d: ours(n, model, port, d, "--itl-target-ms", "off", *extra)),
                (
                    "chunked-32",
                    lambda n, port, d: ours(
                        n, model, port, d, "--max-batched-tokens", "32", "--itl-target-ms", "off", *extra
                    ),
                ),
                ("itl-target-auto", lambda n, port, d: ours(n, model, port, d, *extra)),
            ],
            stream,
            log_dir,
        )
        for name in ("unchunked", "chunked-256", "chunked-32", "itl-target-auto"):
            r = json.loads((log_dir / f"{name}.json").read_text())
            itl = sorted(g for rec in r.get("requests", r if isinstance(r, list) else []) for g in rec.get("itl", []))
            stats = results[name]["itl_ms"]
            results[name]["itl_p99_over_median"] = stats["p99"] / stats["median"]
            results[name]["itl_max_ms"] = 1000 * itl[-1] if itl else None
            print(
                f"{name:>12}: ITL p99 / median = {results[name]['itl_p99_over_median']:.2f}, max ITL "
                f"{results[name]['itl_max_ms'] or float('nan'):.0f} ms, TTFT p99 {results[name]['ttft_ms']['p99']:.0f} ms"
            )
    elif args.scenario == "migration":
        # bursts of long and short requests onto 2 instances whose caches hold about two long ones each
        trace = log_dir / "trace.csv"
        rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
        for burst in range(args.bursts):
            t = burst * args.burst_gap
            rows += [f"{t + 0.01 * i:.2f},{400 if i % 3 == 0 else 48},{256 if i % 3 == 0 else 32}" for i in range(9)]
        trace.write_text("\n".join(rows) + "\n")
        stream = ["--dataset", str(trace), "--prompt-ids", "--ignore-eos", "--seed", "1", "--vocab-size", str(vocab)]
        pressure = ["--instances", "2", "--kv-blocks", str(args.kv_blocks), "--block-size", "16", *extra]
        results = run_pair(
            [
                (
                    "rr",
                    lambda n, port, d: ours(
                        n, model, port, d, *pressure, "--dispatch", "rr", "--migrate-interval", "0"
                    ),
                ),
                (
                    "load",
                    lambda n, port, d: ours(
                        n, model, port, d, *pressure, "--dispatch", "load", "--migrate-interval", "0"
                    ),
                ),
                (
                    "load+migration",
                    lambda n, port, d: ours(
                        n,
                        model,
                        port,
                        d,
                        *pressure,
                        "--dispatch",
                        "load",
                        "--migrate-interval",
                        str(args.migrate_interval),
                    ),
                ),
            ],
            stream,
            log_dir,
        )
        for name in ("rr", "load", "load+migration"):
            r = results[name]
            print(
                f"{name:>15}: TTFT p99 {r['ttft_ms']['p99']:.0f} ms, E2E p99 {r['e2e_ms']['p99']:.0f} ms, "
                f"preemptions {r['preemptions']:.0f}, migrations {r['migrations']:.0f}"
            )
        rr, lm = results["rr"], results["load+migration"]
        results["ratios"] = {
            "ttft_p99_migration_over_rr": lm["ttft_ms"]["p99"] / rr["ttft_ms"]["p99"],
            "preemptions_migration_over_rr": lm["preemptions"] / max(1.0, rr["preemptions"]),
        }
    elif args.scenario == "pd":
        # chats that decode for a while, and long prompts landing among them (as in `chunking`)
        trace = log_dir / "trace.csv"
        rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
        rows += [f"{0.2 * i:.2f},32,160" for i in range(16)]
        rows += [f"{0.5 + 0.6 * i:.2f},{args.long_prompt},16" for i in range(10)]
        trace.write_text("\n".join(rows) + "\n")
        stream = ["--dataset", str(trace), "--prompt-ids", "--ignore-eos", "--seed", "1", "--vocab-size", str(vocab)]
        mixed = ",".join(item.split(":")[-1] for item in args.pd_instances.split(","))
        results = run_pair(
            [
                (
                    "mixed",
                    lambda n, port, d: ours(n, model, port, d, "--instances", mixed, "--migrate-interval", "0", *extra),
                ),
                (
                    "disaggregated",
                    lambda n, port, d: ours(
                        n, model, port, d, "--instances", args.pd_instances, "--migrate-interval", "0", *extra
                    ),
                ),
            ],
            stream,
            log_dir,
        )
        m, pd = results["mixed"], results["disaggregated"]
        results["layouts"] = {"mixed": mixed, "disaggregated": args.pd_instances}
        results["ratios"] = {
            "ttft_p99_mixed_over_pd": m["ttft_ms"]["p99"] / pd["ttft_ms"]["p99"],
            "itl_p99_mixed_over_pd": m["itl_ms"]["p99"] / pd["itl_ms"]["p99"],
            "throughput_pd_over_mixed": pd["output_throughput"] / m["output_throughput"],
        }
    elif args.scenario == "failover":
        results = failover(model, log_dir, common, args, extra)
    elif args.scenario == "llama-server":
        results = against_llama_server(model, log_dir, args, extra)
    elif args.scenario == "vllm-cpu":
        results = against_vllm_cpu(model, log_dir, args, extra)
    else:
        # text prompts (HF's server takes no token ids) and no ignore_eos (HF refuses the field); greedy, so both
        # servers generate the same tokens and stop at the same EOS
        stream = common + [
            "--request-rate",
            str(args.request_rate),
            "--input-len",
            "128",
            "--output-len",
            "64",
            "--model",
            model,
        ]
        hf_cli = shutil.which("transformers", path=str(BIN)) or "transformers"
        results = run_pair(
            [
                ("ours", lambda n, port, d: ours(n, model, port, d, "--served-model-name", model, *extra)),
                (
                    "hf-serve-cb",
                    lambda n, port, d: Server(
                        n,
                        [hf_cli, "serve", model, "--port", str(port), "--continuous-batching"],
                        port,
                        d,
                        env={"HF_HUB_OFFLINE": "1"},
                    ),
                ),
            ],
            stream,
            log_dir,
        )
        o, h = results["ours"], results["hf-serve-cb"]
        results["ratios"] = {
            "throughput_ours_over_hf": o["output_throughput"] / h["output_throughput"],
            "ttft_p99_hf_over_ours": h["ttft_ms"]["p99"] / o["ttft_ms"]["p99"],
        }
    if "ratios" in results:
        print("ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in results["ratios"].items()))
    print(f"uptime after: {os.getloadavg()}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        names = [k for k, v in results.items() if isinstance(v, dict) and "ttft_ms" in v]
        names += [
            k
            for v in results.values()
            if isinstance(v, dict)
            for k, w in v.items()
            if isinstance(w, dict) and "ttft_ms" in w
        ]  # llama-server: a level per load
        plot(log_dir, names, Path(args.plot), f"{args.scenario}: {Path(model).name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

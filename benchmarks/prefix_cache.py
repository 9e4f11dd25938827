"""Prefix caching's goals, side by side in one run each; every figure in docs/benchmarks.md's
prefix caching section comes from here.

    python benchmarks/prefix_cache.py shared     # one instance, a 1,024-token shared prompt: caching on vs off
    python benchmarks/prefix_cache.py dispatch   # two instances, 8 prefixes, Poisson: --dispatch prefix vs load
    python benchmarks/prefix_cache.py migration  # bytes and downtime of a move onto a cached prefix vs a cold one
    python benchmarks/prefix_cache.py multiturn  # TTFT by turn of replayed chats, caching on vs off

The servers are `dist-infer serve` on the default model (tp=1 instances), bench-serve the load
generator (serve_compare.py's helpers). Only 127.0.0.1 is ever contacted. Check `uptime` before and
after: figures count on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

import httpx
from serve_compare import free_port, ours, run_pair, vocab_size

PREFIX_LEN, SUFFIX_LEN = 1024, 64


def same_tokens(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of `prompts`, one after another (what 'same tokens' compares across servers)."""
    out = []
    for prompt in prompts:
        r = httpx.post(
            url + "/v1/completions",
            timeout=600,
            json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        )
        r.raise_for_status()
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def shared(model: str, log_dir: Path, args, vocab: int) -> dict:
    rng = random.Random(7)
    stream = [
        "--dataset",
        "prefix",
        "--num-prefixes",
        "1",
        "--prefix-len",
        str(PREFIX_LEN),
        "--suffix-len",
        str(SUFFIX_LEN),
        "--output-len",
        str(args.output_len),
        "--prompt-ids",
        "--ignore-eos",
        "--seed",
        "1",
        "--vocab-size",
        str(vocab),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.concurrency),
    ]
    system = [rng.randrange(3, vocab) for _ in range(PREFIX_LEN)]
    check = [system + [rng.randrange(3, vocab) for _ in range(SUFFIX_LEN)] for _ in range(4)]
    tokens: dict = {}  # after each stream, the greedy ids of the same `check` prompts

    def record_tokens(name, server):
        tokens[name] = same_tokens(server.url, check, 16)

    results = run_pair(
        [
            (name, lambda n, port, d, f=flag: ours(n, model, port, d, "--prefix-caching", f, *args.extra))
            for name, flag in (("caching-off", "off"), ("caching-on", "on"))
        ],
        stream,
        log_dir,
        after=record_tokens,
    )
    on, off = results["caching-on"], results["caching-off"]
    results["ratios"] = {
        "ttft_p50_on_over_off": on["ttft_ms"]["median"] / off["ttft_ms"]["median"],
        "throughput_on_over_off": on["output_throughput"] / off["output_throughput"],
        "same_tokens": tokens["caching-on"] == tokens["caching-off"],
    }
    return results


def dispatch(model: str, log_dir: Path, args, vocab: int) -> dict:
    n = args.num_prompts
    stream = [
        "--dataset",
        "prefix",
        "--num-prefixes",
        "8",
        "--prefix-len",
        str(PREFIX_LEN),
        "--suffix-len",
        str(SUFFIX_LEN),
        "--output-len",
        str(args.output_len),
        "--prompt-ids",
        "--ignore-eos",
        "--seed",
        "1",
        "--vocab-size",
        str(vocab),
        "--num-prompts",
        str(n),
        "--request-rate",
        str(args.request_rate),
    ]
    fleet = ["--instances", "tp1,tp1", "--kv-blocks", str(args.kv_blocks), "--migrate-interval", "0", *args.extra]
    results = run_pair(
        [
            (policy, lambda name, port, d, p=policy: ours(name, model, port, d, *fleet, "--dispatch", p))
            for policy in ("load", "prefix")
        ],
        stream,
        log_dir,
    )
    ideal = (n - 8) * PREFIX_LEN / (n * (PREFIX_LEN + SUFFIX_LEN))  # every request after its prefix's first hits it
    pre, load = results["prefix"], results["load"]
    results["ideal_hit_rate"] = ideal
    results["ratios"] = {
        "ttft_p99_prefix_over_load": pre["ttft_ms"]["p99"] / load["ttft_ms"]["p99"],
        "hit_rate_prefix_over_ideal": (pre.get("prefix_cache_hit_rate") or 0.0) / ideal,
        "hit_rate_load_over_ideal": (load.get("prefix_cache_hit_rate") or 0.0) / ideal,
    }
    return results


def _move(client: httpx.Client, url: str, prompt: list[int], after: int = 8) -> dict:
    """Stream one greedy request, move it to the other instance after `after` tokens; the move's result."""
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
    seen, result = 0, None
    with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            seen += len(event["choices"][0].get("token_ids") or [])
            if result is None and seen >= after:
                insts = client.get(url + "/admin/instances").json()["instances"]
                src = next(i["index"] for i in insts if event["id"] in i["requests"])
                result = client.post(
                    url + "/admin/migrate", timeout=600, json={"request_id": event["id"], "to_instance": 1 - src}
                ).json()
    return result.get("migration", result)


def migration(model: str, log_dir: Path, args, vocab: int) -> dict:
    """rr dispatch: two warm-up requests put the shared prefix in both instances' caches; then each
    repeat moves a request on it (warm: its destination holds the prefix) and one on a prefix no
    instance has seen (cold), the same lengths."""
    rng = random.Random(3)
    system = [rng.randrange(3, vocab) for _ in range(PREFIX_LEN)]
    server = ours(
        "migration",
        model,
        free_port(),
        log_dir,
        "--instances",
        "tp1,tp1",
        "--dispatch",
        "rr",
        "--migrate-interval",
        "0",
        "--kv-blocks",
        "600",
        *args.extra,
    )
    rows: dict = {"warm": [], "cold": []}
    try:
        with httpx.Client() as client:
            for _ in range(2):
                same_tokens(server.url, [system + [rng.randrange(3, vocab) for _ in range(SUFFIX_LEN)]], 2)
            for _ in range(args.repeat):
                for kind in ("warm", "cold"):
                    prefix = system if kind == "warm" else [rng.randrange(3, vocab) for _ in range(PREFIX_LEN)]
                    rows[kind].append(
                        _move(client, server.url, prefix + [rng.randrange(3, vocab) for _ in range(SUFFIX_LEN)])
                    )
    finally:
        server.stop()
    summary = {}
    for kind, moves in rows.items():
        assert all(m["outcome"] == "ok" for m in moves), moves
        summary[kind] = {
            "bytes": statistics.median(m["bytes"] for m in moves),
            "blocks": statistics.median(m["blocks"] for m in moves),
            "held_blocks": statistics.median(m["held_blocks"] for m in moves),
            "downtime_ms": statistics.median(1e3 * m["downtime_s"] for m in moves),
            "downtime_ms_all": [round(1e3 * m["downtime_s"], 1) for m in moves],
        }
        print(f"{kind}: {summary[kind]}", flush=True)
    summary["ratios"] = {
        "bytes_warm_over_cold": summary["warm"]["bytes"] / summary["cold"]["bytes"],
        "downtime_warm_over_cold": summary["warm"]["downtime_ms"] / summary["cold"]["downtime_ms"],
    }
    return summary


def multiturn(model: str, log_dir: Path, args, vocab: int) -> dict:
    stream = [
        "--dataset",
        "multiturn",
        "--turns",
        "5",
        "--prefix-len",
        "256",
        "--num-prefixes",
        "8",
        "--suffix-len",
        str(SUFFIX_LEN),
        "--output-len",
        str(args.output_len),
        "--prompt-ids",
        "--ignore-eos",
        "--seed",
        "1",
        "--vocab-size",
        str(vocab),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(args.request_rate),
    ]
    results = run_pair(
        [
            (name, lambda n, port, d, f=flag: ours(n, model, port, d, "--prefix-caching", f, *args.extra))
            for name, flag in (("caching-off", "off"), ("caching-on", "on"))
        ],
        stream,
        log_dir,
    )
    ratios = {}
    for name in ("caching-off", "caching-on"):
        by_turn = results[name]["ttft_ms_by_turn"]
        print(f"{name}: TTFT p50 by turn (ms) {by_turn}", flush=True)
        ratios[f"ttft_turn5_over_turn1_{name}"] = by_turn["5"] / by_turn["1"]
    results["ratios"] = ratios
    return results


SCENARIOS = {"shared": shared, "dispatch": dispatch, "migration": migration, "multiturn": multiturn}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=tuple(SCENARIOS))
    p.add_argument("--model", default="default", help="checkpoint directory or GGUF, or 'default' (the built-in model)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests (multiturn: conversations)")
    p.add_argument("--concurrency", type=int, default=4, help="shared: requests in flight at once")
    p.add_argument("--request-rate", type=float, default=1.0, help="dispatch, multiturn: Poisson requests per second")
    p.add_argument("--output-len", type=int, default=32, help="tokens each request generates")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=512,
        help="dispatch: KV blocks per instance (16 tokens): 512 holds 8 prefixes only with nothing running",
    )
    p.add_argument("--repeat", type=int, default=3, help="migration: moves of each kind (medians reported)")
    p.add_argument("--flags", default="", help="extra flags for our server")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    args.extra = args.flags.split()
    from dist_infer.models.builtin import resolve_model

    model = resolve_model(args.model)
    log_dir = Path(tempfile.mkdtemp(prefix=f"prefix-{args.scenario}-"))
    print(f"uptime before: {os.getloadavg()}; logs in {log_dir}", flush=True)
    results = SCENARIOS[args.scenario](model, log_dir, args, vocab_size(model))
    print(json.dumps(results.get("ratios", {})), flush=True)
    print(f"uptime after: {os.getloadavg()}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

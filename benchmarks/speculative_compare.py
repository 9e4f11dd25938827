"""Speculative decoding side by side in one run: `bench-serve --dataset copy` (tasks whose answers
repeat their prompt) and `--dataset write` (nothing to copy) against our server with and without
`--speculative ngram`, and llama.cpp's server with and without its own n-gram speculation
(`--spec-type ngram-mod`, short lookups: see --llama-spec), on the same GGUF, the same chat prompts and the same load, each run
on a server started afresh (no prompt cache carries over), a new seed per dataset and load:

    python benchmarks/speculative_compare.py [--loads c1,c8] [--out FILE]

Prints each run (with our acceptance from /metrics) and the ratios the speculative goals are
stated in: decode tok/s (1000 / mean TPOT) at c1, requests/s at c8. Only 127.0.0.1 is ever
contacted; figures count on a quiet machine (check the load printed before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from serve_compare import bench, free_port, llama_server, ours


def run(name: str, start, stream: list[str], log_dir: Path) -> dict:
    server = start(name, free_port(), log_dir)
    try:
        result = bench(server.url, stream, log_dir / f"{name}.json")  # its spec_* keys: from our /metrics
    finally:
        server.stop()
    drafted, accepted = result.get("spec_draft_tokens") or 0, result.get("spec_accepted_tokens") or 0
    result["decode_tok_s"] = 1000.0 / result["tpot_ms"]["mean"] if result["tpot_ms"]["mean"] else None
    print(
        f"{name:>22}: {result['completed']} ok / {result['failed']} failed, {result['request_throughput']:.3f} req/s, "
        f"{result['output_throughput']:.1f} out tok/s, decode {result['decode_tok_s'] or 0:.1f} tok/s, TTFT p50 "
        f"{result['ttft_ms']['median']:.0f} ms, TPOT p50 {result['tpot_ms']['median']:.1f} ms"
        + (f", accepted {accepted:.0f} of {drafted:.0f} proposed" if drafted else ""),
        flush=True,
    )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a GGUF file, or 'default' (the built-in model)")
    p.add_argument("--loads", default="c1,c8", help="cN: N requests at a time")
    p.add_argument("--prompts-per-slot", type=int, default=6, help="requests per concurrent slot (c8: 48)")
    p.add_argument("--output-len", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--datasets", default="copy,write")
    p.add_argument("--flags", default="", help="extra flags for our server (both runs)")
    p.add_argument("--spec-flags", default="--speculative ngram", help="our speculative run's flags")
    p.add_argument(
        "--llama-spec",
        # its best n-gram mode on this stream: ngram-simple with its defaults (12-token lookups, 48-token
        # drafts) ran at 0.43x its plain decode, with 3 / 6 at 1.0x; ngram-mod with short lookups gained
        default="--spec-type ngram-mod --spec-ngram-mod-n-match 4 --spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max 6",
        help="llama-server's speculative flags",
    )
    p.add_argument("--out", default=None, help="write the combined JSON here")
    p.add_argument("--llama-server", default=shutil.which("llama-server") or "", help="llama.cpp's server binary")
    args = p.parse_args()
    from dist_infer.models.builtin import resolve_model

    model = resolve_model(args.model)
    log_dir = Path(tempfile.mkdtemp(prefix="speculative-compare-"))
    print(f"load before: {os.getloadavg()}; logs in {log_dir}", flush=True)
    flags = args.flags.split()
    results: dict = {}
    seed = 100
    for dataset in args.datasets.split(","):
        for load in args.loads.split(","):
            n = int(load[1:])
            seed += 1
            stream = ["--endpoint", "chat", "--dataset", dataset, "--num-prompts", str(n * args.prompts_per_slot)]
            stream += ["--seed", str(seed), "--max-concurrency", str(n), "--output-len", str(args.output_len)]
            stream += ["--temperature", "0"]
            runs = {
                "ours-plain": lambda name, port, d: ours(name, model, port, d, *flags),
                "ours-ngram": lambda name, port, d: ours(name, model, port, d, *flags, *args.spec_flags.split()),
            }
            if args.llama_server:
                runs["llama-plain"] = llama_server(args.llama_server, model, n, 2048)
                runs["llama-ngram"] = llama_server(args.llama_server, model, n, 2048, *args.llama_spec.split())
            key = f"{dataset}@{load}"
            results[key] = {name: run(f"{name}@{key}", start, stream, log_dir) for name, start in runs.items()}
            r = results[key]
            metric = "decode_tok_s" if n == 1 else "request_throughput"
            ratios = {f"{metric}_ngram_over_plain": r["ours-ngram"][metric] / r["ours-plain"][metric]}
            if "llama-ngram" in r:
                ratios[f"{metric}_ours_ngram_over_llama_ngram"] = r["ours-ngram"][metric] / r["llama-ngram"][metric]
                ratios[f"{metric}_llama_ngram_over_plain"] = r["llama-ngram"][metric] / r["llama-plain"][metric]
            r["ratios"] = ratios
            print(f"{key}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()), flush=True)
    if not args.llama_server:
        print("no llama-server binary (make llama-cpp, or --llama-server): the peer's runs are skipped", flush=True)
    print(json.dumps({k: v["ratios"] for k, v in results.items()}), flush=True)
    print(f"load after: {os.getloadavg()}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Structured outputs side by side in one run: `bench-serve --dataset json-schema` (120 schemas of
seven shapes, every answer checked against its schema) against our server and llama.cpp's, on the
same GGUF, the same chat prompts and the same concurrency, each run on a server started afresh (no
prompt cache carries over):

- ours, every request constrained (strict json_schema), at temperature 0 and 1;
- ours, the temperature-0 stream again unconstrained, each request asking for exactly the tokens it
  generated constrained (--replay-lengths, --ignore-eos): the throughput the grammar costs (the
  constrained and unconstrained pair twice, in both orders);
- llama.cpp's server, constrained, at temperature 0 and 1.

    python benchmarks/structured_compare.py [--num-prompts 120] [--concurrency 8] [--out FILE]

Prints each run and the ratios the structured-output goals are stated in. Only 127.0.0.1 is ever
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
        result = bench(server.url, stream, log_dir / f"{name}.json")
    finally:
        server.stop()
    rate = result.get("schema_validity_rate")
    hidden = result.get("grammar_hidden")
    print(
        f"{name:>16}: {result['completed']} ok / {result['failed']} failed, {result['request_throughput']:.2f} req/s, "
        f"{result['output_throughput']:.1f} out tok/s, TTFT p50 {result['ttft_ms']['median']:.0f} ms, ITL p50 "
        f"{result['itl_ms']['median']:.1f} p99 {result['itl_ms']['p99']:.1f} ms"
        + (f", valid {100 * rate:.1f}% ({result['schema_truncated']} cut)" if rate is not None else "")
        + (
            f", grammar {100 * result['grammar_share_of_step']:.1f}% of steps, {100 * hidden:.0f}% hidden"
            if hidden is not None
            else ""
        ),
        flush=True,
    )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a GGUF file, or 'default' (the built-in model)")
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--output-len", type=int, default=256, help="max_tokens of each constrained request")
    p.add_argument("--seed", type=int, default=7, help="which schemas (bench-serve --seed)")
    p.add_argument("--flags", default="", help="extra flags for our server")
    p.add_argument("--out", default=None, help="write the combined JSON here")
    p.add_argument("--llama-server", default=shutil.which("llama-server") or "", help="llama.cpp's server binary")
    args = p.parse_args()
    from dist_infer.models.builtin import resolve_model

    model = resolve_model(args.model)
    log_dir = Path(tempfile.mkdtemp(prefix="structured-compare-"))
    print(f"load before: {os.getloadavg()}; logs in {log_dir}", flush=True)
    common = ["--endpoint", "chat", "--dataset", "json-schema", "--num-prompts", str(args.num_prompts)]
    common += [
        "--seed",
        str(args.seed),
        "--max-concurrency",
        str(args.concurrency),
        "--output-len",
        str(args.output_len),
    ]
    ours_start = lambda n, port, d: ours(n, model, port, d, *args.flags.split())  # noqa: E731
    results: dict = {}
    t0 = common + ["--temperature", "0"]
    results["ours-strict-t0"] = run("ours-strict-t0", ours_start, t0, log_dir)
    replay = ["--unconstrained", "--ignore-eos", "--replay-lengths", str(log_dir / "ours-strict-t0.json")]
    results["ours-free-t0"] = run("ours-free-t0", ours_start, t0 + replay, log_dir)
    # the pair again in the other order (the VM drifts between runs: the ratio is of the two pairs' sums)
    results["ours-free-t0-b"] = run("ours-free-t0-b", ours_start, t0 + replay, log_dir)
    results["ours-strict-t0-b"] = run("ours-strict-t0-b", ours_start, t0, log_dir)
    results["ours-strict-t1"] = run("ours-strict-t1", ours_start, common + ["--temperature", "1"], log_dir)
    pairs = [(results[f"ours-strict-t0{s}"], results[f"ours-free-t0{s}"]) for s in ("", "-b")]
    ratios = {
        "throughput_strict_over_free": sum(a["output_throughput"] for a, _ in pairs)
        / sum(b["output_throughput"] for _, b in pairs),
        "throughput_strict_over_free_each": [a["output_throughput"] / b["output_throughput"] for a, b in pairs],
        "grammar_hidden_t0": results["ours-strict-t0"]["grammar_hidden"],
        "grammar_hidden_t1": results["ours-strict-t1"]["grammar_hidden"],
    }
    if args.llama_server:
        peer = llama_server(args.llama_server, model, args.concurrency, 1024)
        for t in ("0", "1"):
            results[f"llama-strict-t{t}"] = run(f"llama-strict-t{t}", peer, common + ["--temperature", t], log_dir)
            mine, theirs = results[f"ours-strict-t{t}"], results[f"llama-strict-t{t}"]
            ratios[f"req_s_ours_over_llama_t{t}"] = mine["request_throughput"] / theirs["request_throughput"]
            ratios[f"validity_ours_t{t}"] = mine["schema_validity_rate"]
            ratios[f"validity_llama_t{t}"] = theirs["schema_validity_rate"]
    else:
        print("no llama-server binary (make llama-cpp, or --llama-server): the peer's runs are skipped", flush=True)
    results["ratios"] = ratios
    print("ratios: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in ratios.items()))
    print(json.dumps(ratios), flush=True)
    print(f"load after: {os.getloadavg()}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

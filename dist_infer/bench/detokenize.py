"""The front end's text cost per token: incremental detokenizing against decoding the whole
output again on every token (what the engine's driver did before the front end detokenized), side by side.

    python -m dist_infer.bench.detokenize [--lengths 256,2048,8192] [--requests 256] [--json]

Per token, each way decodes one request's output token by token with one stop string that
never matches (so the search runs on every token); a step at `--requests` running requests pays
that for each of them. Results: docs/benchmarks.md, "Detokenizing in the front end".
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from dist_infer.serving.http.detokenizer import IncrementalDetokenizer

SAMPLE = (
    "The quick brown fox jumps over the lazy dog; Grüße aus Köln, 世界 🙂. "
    "Serving systems stream tokens to many users at once, and each one needs its text. "
)
STOP = ("<never-in-the-text>",)


def whole_decode_per_token(tokenizer, ids: list[int]) -> str:
    """The old way: the whole output decoded after every token, the stop searched in the new part."""
    text, longest = "", max(len(s) for s in STOP)
    for n in range(1, len(ids) + 1):
        before = len(text)
        text = tokenizer.decode(ids[:n])
        start = max(0, before - longest + 1)
        if any(text.find(s, start) >= 0 for s in STOP):
            break
    return text


def incremental(tokenizer, ids: list[int]) -> str:
    d = IncrementalDetokenizer(tokenizer, STOP)
    for t in ids:
        d.add(t)
    d.finish()
    return d.text


def time_per_token(fn, tokenizer, ids: list[int], min_s: float = 0.5) -> float:
    """Seconds per token of `fn` over `ids`, repeated for at least `min_s`."""
    runs, start = 0, time.perf_counter()
    while True:
        fn(tokenizer, ids)
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / (runs * len(ids))


def measure(tokenizer, lengths: list[int], requests: int) -> list[dict]:
    base = tokenizer.encode(SAMPLE, add_bos=False)
    rows = []
    for n in lengths:
        ids = (base * (n // len(base) + 1))[:n]
        assert incremental(tokenizer, ids) == tokenizer.decode(ids), "the two ways must give the same text"
        old = time_per_token(whole_decode_per_token, tokenizer, ids)
        new = time_per_token(incremental, tokenizer, ids)
        rows.append(
            {
                "output_tokens": n,
                "whole_us_per_token": old * 1e6,
                "incremental_us_per_token": new * 1e6,
                "speedup": old / new,
                "requests": requests,
                "whole_ms_per_step": old * requests * 1e3,
                "incremental_ms_per_step": new * requests * 1e3,
            }
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dist_infer.bench.detokenize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="the checkpoint whose tokenizer to use (default: SmolLM2)")
    parser.add_argument("--lengths", default="256,2048,8192", help="output lengths in tokens, comma-separated")
    parser.add_argument("--requests", type=int, default=256, help="running requests a step serves (for ms per step)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.models.builtin import resolve_model

    tokenizer = TextTokenizer(resolve_model(args.model))
    rows = measure(tokenizer, [int(x) for x in args.lengths.split(",") if x], args.requests)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(
        f"{'output tokens':>13} {'whole us/tok':>12} {'incr. us/tok':>12} {'speedup':>8} "
        f"{'whole ms/step':>13} {'incr. ms/step':>13}  (at {args.requests} requests)"
    )
    for r in rows:
        print(
            f"{r['output_tokens']:>13} {r['whole_us_per_token']:>12.1f} {r['incremental_us_per_token']:>12.1f} "
            f"{r['speedup']:>7.1f}x {r['whole_ms_per_step']:>13.1f} {r['incremental_ms_per_step']:>13.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

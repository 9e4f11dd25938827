"""The prefix cache as a side channel between API keys, with --prefix-cache-isolation none vs key
(docs/security.md's figures come from here).

For each of N prefixes of 1,000 tokens: key alice sends prefix + a tail (cold), key bob sends the same
prefix + another tail, then alice again. The median time to first token of each: under `none`, bob's
request is served from alice's cached prefix, and so answers as soon as alice's second does (the
leak); under `key` it is computed again, as slow as cold.

    python benchmarks/prefix_cache_isolation.py              # a random llama (hidden 512, 8 layers), written here
    python benchmarks/prefix_cache_isolation.py --model DIR  # any checkpoint

Servers are `dist-infer serve` (one tp1 instance) on 127.0.0.1 only. Check `uptime` first: the
figures count on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_compare import free_port, ours, vocab_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from checkpoints import write_hf_checkpoint  # noqa: E402

KEYS = {"alice": "key-alice", "bob": "key-bob"}
PREFIX_LEN = 1000


async def ttft(url: str, key: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed request to its first token's chunk."""
    start = time.perf_counter()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=600, trust_env=False) as c:
        body = {"prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0, "ignore_eos": True}
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise SystemExit(f"{r.status_code}: {(await r.aread())[:500]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return time.perf_counter() - start
    raise SystemExit("the stream ended without a token")


async def measure(url: str, prefixes: list[list[int]], vocab: int) -> dict[str, float]:
    """Median TTFT (ms) of alice cold, bob on alice's prefix, alice again."""
    await ttft(url, KEYS["alice"], [5] * 50)  # warm-up
    times: dict[str, list[float]] = {"alice, cold": [], "bob, same prefix": [], "alice again": []}
    for prefix in prefixes:
        tails = [[vocab - 1 - k, vocab - 2 - k] for k in range(3)]
        times["alice, cold"].append(await ttft(url, KEYS["alice"], prefix + tails[0]))
        times["bob, same prefix"].append(await ttft(url, KEYS["bob"], prefix + tails[1]))
        times["alice again"].append(await ttft(url, KEYS["alice"], prefix + tails[2]))
    return {name: statistics.median(t) * 1000 for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: a random llama written here)")
    p.add_argument(
        "--prefixes", type=int, default=7, help="prefixes measured, each with a cold, a cross-key and a warm request"
    )
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="isolation-bench-"))
    model = args.model or str(
        write_hf_checkpoint(
            work,
            "llama-gqa",
            max_position_embeddings=2048,
            hidden_size=512,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1408,
        )
    )
    vocab = vocab_size(model)
    prefixes = [[3 + (i * (7 + n) + n) % (vocab - 10) for i in range(PREFIX_LEN)] for n in range(args.prefixes)]
    for mode in ("none", "key"):
        flags = ["--kv-blocks", "1200", "--prefix-cache-isolation", mode]
        for key in KEYS.values():
            flags += ["--api-key", key]
        server = ours(mode, model, free_port(), work, *flags)
        try:
            result = asyncio.run(measure(server.url, prefixes, vocab))
        finally:
            server.stop()
        shown = ", ".join(f"{name} {ms:,.0f} ms" for name, ms in result.items())
        print(
            f"--prefix-cache-isolation {mode}: {shown}; bob is "
            f"{result['alice, cold'] / result['bob, same prefix']:.1f}x sooner than cold",
            flush=True,
        )


if __name__ == "__main__":
    main()

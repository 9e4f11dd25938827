"""Downtime of a migrated request vs its context length: live (KV copied in stages) vs recompute.

Starts `dist-infer serve --instances 2` on --model, and for each context length streams one
greedy request, moves it to the other instance after a few tokens, and measures the stall its
client sees: the longest gap between two tokens from the migration on (the gap a client would
notice). Live migration copies the KV while the request decodes and stops it only for the last
few blocks; recompute (the baseline) stops it and prefills every token again on the destination.
Also reports the server's own downtime (from the source's report that the request is paused,
its last step there done, to the destination's that it has taken it over), the client's stall
less one ordinary token gap, and the KV bytes a live migration moved per second of its duration.

    python benchmarks/migration_downtime.py --model /tmp/llama125m-16k --contexts 1024,2048,4096,8192
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

GEN = 48  # tokens per request
MOVE_AFTER = 8  # tokens before the migration is forced


def start_server(args, workdir: Path) -> tuple[subprocess.Popen, str]:
    ready = workdir / "ready.json"
    log = open(workdir / "serve.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "dist_infer",
        "serve",
        "--model",
        args.model,
        "--instances",
        args.instances,
        "--block-size",
        "16",
        "--kv-blocks",
        str(args.kv_blocks),
        "--max-batched-tokens",
        str(args.chunk),
        "--migrate-interval",
        "0",
        "--port",
        "0",
        "--ready-file",
        str(ready),
        "--timeout",
        "600",
        "--migration-timeout",
        "600",
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start: see {workdir / 'serve.log'}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], mode: str) -> dict:
    """Stream one request; migrate it after MOVE_AFTER tokens; the client-side stall and the server's report."""
    times: list[float] = []
    body = {"prompt": prompt, "max_tokens": GEN, "temperature": 0, "ignore_eos": True, "stream": True}
    move = None
    moved_at = None
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            n = len(event["choices"][0].get("token_ids") or [])
            times += [time.perf_counter()] * n
            if move is None and len(times) >= MOVE_AFTER:
                insts = (await client.get(url + "/admin/instances")).json()["instances"]
                src = next(i["index"] for i in insts if event["id"] in i["requests"])
                moved_at = len(times)
                move = asyncio.create_task(
                    client.post(
                        url + "/admin/migrate",
                        timeout=3600,
                        json={"request_id": event["id"], "to_instance": 1 - src, "mode": mode},
                    )
                )
    result = (await move).json()
    gaps = [b - a for a, b in zip(times[moved_at - 1 :], times[moved_at:])]
    steady = [b - a for a, b in zip(times[1 : moved_at - 1], times[2:moved_at])]
    return {"stall_s": max(gaps), "token_gap_s": statistics.median(steady), "server": result.get("migration", result)}


async def run(args) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="migration-bench-"))
    proc, url = start_server(args, workdir)
    rows = []
    try:
        rng = random.Random(0)
        async with httpx.AsyncClient() as client:
            for context in args.contexts:
                for mode in ("live", "recompute"):
                    samples = []
                    for rep in range(args.repeat):
                        prompt = [rng.randrange(3, args.vocab) for _ in range(context)]
                        samples.append(await one(client, url, prompt, mode))
                    stalls = sorted(s["stall_s"] for s in samples)
                    server = [s["server"] for s in samples]
                    row = {
                        "context": context,
                        "mode": mode,
                        "stall_ms": 1e3 * statistics.median(stalls),
                        "stall_ms_all": [round(1e3 * x, 1) for x in stalls],
                        "token_gap_ms": 1e3 * statistics.median(s["token_gap_s"] for s in samples),
                        "outcomes": [s.get("outcome") for s in server],
                    }
                    if mode == "live":
                        row["server_downtime_ms"] = 1e3 * statistics.median(s["downtime_s"] for s in server)
                        row["extra_stall_ms"] = row["stall_ms"] - row["token_gap_ms"]
                        row["stages"] = statistics.median(s["stages"] for s in server)
                        row["mb"] = statistics.median(s["bytes"] for s in server) / 1e6
                        row["mb_per_s"] = statistics.median(s["bytes"] / s["total_s"] for s in server) / 1e6
                        row["phases_ms"] = [s.get("phases_ms") for s in server]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    return rows


def table(rows: list[dict]) -> str:
    by = {(r["context"], r["mode"]): r for r in rows}
    out = [
        "| context | token gap ms | live stall ms | stall - gap ms | server downtime ms | stages | KV moved MB | MB/s | "
        "recompute stall ms | recompute / live |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for context in sorted({r["context"] for r in rows}):
        live, rec = by[(context, "live")], by[(context, "recompute")]
        out.append(
            f"| {context} | {live['token_gap_ms']:.1f} | {live['stall_ms']:.1f} | {live['extra_stall_ms']:.1f} | "
            f"{live['server_downtime_ms']:.1f} | {live['stages']:.0f} | "
            f"{live['mb']:.1f} | {live['mb_per_s']:.0f} | {rec['stall_ms']:.1f} | "
            f"**{rec['stall_ms'] / live['stall_ms']:.1f}** |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint with enough positions for the longest context")
    p.add_argument("--contexts", default="1024,2048,4096,8192", help="prompt lengths, comma-separated")
    p.add_argument("--instances", default="tp1,tp1", help="the two instances (default %(default)s)")
    p.add_argument("--kv-blocks", type=int, default=1100, help="KV blocks per instance (16 tokens each)")
    p.add_argument("--chunk", type=int, default=2048, help="--max-batched-tokens of the server")
    p.add_argument("--repeat", type=int, default=3, help="requests per context and mode (median reported)")
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    rows = asyncio.run(run(args))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""What a request sees when its instance dies, with its KV mirrored to a buddy (--kv-mirror buddy)
and without (the survivor recomputes its whole context), in one run on one machine:

    python benchmarks/failover.py [--contexts 1024,8000] [--repeat 3] [--steady c8] [--chaos 20] [--out FILE]

gap: two instances (tp1,tp1) of --model; for each context length a request of that many prompt
tokens streams (greedy, ignore_eos) beside a steady background stream (--background requests at a
time, short prompts); after --kill-after tokens every process of the instance running it is
SIGKILLed. The gap is the time its client waits from its last token before the death to its next;
lost tokens are those its stream misses against the same request run alone afterwards (exactness);
the survivor's dist_infer:kv_mirror_failover_recomputed_tokens says how much it computed again.
The dead instance is restarted (/admin/instances/N/restart) before the next sample.

steady: bench-serve at each load with mirroring on and off (a fresh server and seed each):
requests/s, TTFT p50, ITL p99, the time steps spent on mirroring against the step time, and the
per-request mirror lag (quantiles, blocks; while a prompt's blocks are among them, and after) from the
instances' stats.

chaos: --chaos kills in a row (the two instances in turn) under a stream of four requests at a time,
each round with a forced live migration first, the controller's rounds and prefix caching on; every
stream is checked against its run alone and none may fail.

Only 127.0.0.1 is contacted; figures count on a quiet machine (the load is printed before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from serve_compare import bench, free_port, ours, scrape, vocab_size

from dist_infer.engine.mirror.source import LAG_PHASES
from dist_infer.serving.http.mirror_metrics import lag_quantile, lag_samples

OUT_TOKENS = 64


def server(model: str, mirror: str, log_dir: Path, name: str, *flags: str):
    return ours(
        name,
        model,
        free_port(),
        log_dir,
        "--instances",
        "tp1,tp1",
        "--kv-mirror",
        mirror,
        "--migrate-interval",
        "0",
        "--timeout",
        "600",
        *flags,
    )


async def stream(client, url: str, prompt: list[int], max_tokens: int, on_token=None) -> dict:
    """Stream a greedy request: its ids, each token's arrival time, its id."""
    ids, times, request_id = [], [], None
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            request_id = event["id"]
            new = event["choices"][0].get("token_ids") or []
            ids += new
            times += [time.perf_counter()] * len(new)
            if on_token is not None and new:
                await on_token(request_id, len(ids))
    return {"id": request_id, "ids": ids, "times": times}


async def background(client, url: str, rng: random.Random, vocab: int, stop: asyncio.Event, slots: int):
    """`slots` short requests at a time until `stop`: the steady stream the kill happens in."""

    async def slot():
        while not stop.is_set():
            prompt = [rng.randrange(3, vocab) for _ in range(128)]
            try:
                await stream(client, url, prompt, 32)
            except httpx.HTTPError:
                pass

    await asyncio.gather(*(slot() for _ in range(slots)))


async def instances(client, url: str) -> list[dict]:
    return (await client.get(url + "/admin/instances", timeout=30)).json()["instances"]


async def kill_sample(client, url: str, prompt: list[int], kill_after: int) -> dict:
    """One request killed mid-decode: the gap its client sees, what the survivor recomputed."""

    def recomputed() -> dict[int, float]:  # per instance: a restarted one counts from 0 again
        return {i["index"]: (i.get("kv_mirror") or {}).get("failover_recomputed_tokens", 0) for i in insts_now}

    insts_now = await instances(client, url)
    before = recomputed()
    killed: dict = {}

    victim: dict = {}

    async def kill(request_id, n):
        # the instance running it is looked up at its first tokens (migrations are off), so that the
        # kill itself is no more than the signals: an HTTP round trip at the kill would count in the gap
        if not victim:
            insts = await instances(client, url)
            victim.update(next(i for i in insts if request_id in i["requests"]))
        if n >= kill_after and not killed:
            killed.update(index=victim["index"], at=n, time=time.perf_counter())
            for pid in victim["pids"]:
                os.kill(pid, signal.SIGKILL)

    got = await stream(client, url, prompt, OUT_TOKENS, kill)
    if not killed:
        raise SystemExit(f"the request ended with {len(got['ids'])} tokens, never killed (too long a context?)")
    times = got["times"]
    at = killed["at"]  # tokens the client had when it killed; the gap around the death is the largest after
    gaps = [b - a for a, b in zip(times[at - 1 :], times[at:])]
    steady = [b - a for a, b in zip(times[1 : at - 1], times[2:at])]
    return {
        "request": got,
        "gap_ms": 1e3 * max(gaps) if gaps else None,
        "token_gap_ms": 1e3 * statistics.median(steady) if steady else None,
        "recomputed_tokens": await survivors_recomputed(client, url, killed["index"], before),
        "victim": killed["index"],
    }


async def survivors_recomputed(client, url: str, victim: int, before: dict[int, float]) -> float:
    """Tokens the instances other than `victim` computed again for failed-over requests since `before`
    (their stats lag a step: read once they have reported)."""
    await asyncio.sleep(0.3)
    insts = await instances(client, url)
    return sum(
        (i.get("kv_mirror") or {}).get("failover_recomputed_tokens", 0) - before.get(i["index"], 0)
        for i in insts
        if i["index"] != victim
    )


async def seen_dead(client, url: str, index: int, timeout: float = 60.0) -> None:
    """Until the front end has seen instance `index` die."""
    deadline = time.monotonic() + timeout
    while (await instances(client, url))[index]["state"] == "serving":
        if time.monotonic() > deadline:
            raise SystemExit(f"instance {index} still serving {timeout:.0f} s after it was killed")
        await asyncio.sleep(0.05)


async def restart(client, url: str, index: int) -> float:
    started = time.monotonic()
    r = await client.post(url + f"/admin/instances/{index}/restart", timeout=60)
    assert r.status_code == 202, r.text
    while (await instances(client, url))[index]["state"] != "serving":
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def gap_run(url: str, args, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    async with httpx.AsyncClient() as client:
        stop = asyncio.Event()
        load = asyncio.create_task(background(client, url, random.Random(seed + 1), vocab, stop, args.background))
        for context in args.contexts:
            for _ in range(args.repeat):
                prompt = [rng.randrange(3, vocab) for _ in range(context)]
                # a uniform point within a block: what is recomputed is the partial last block (and
                # whatever is not mirrored yet), so a kill on a block boundary would be the worst case
                kill_at = args.kill_after + rng.randrange(16)
                sample = await kill_sample(client, url, prompt, kill_at)
                restart_s = await restart(client, url, sample["victim"])
                alone = await stream(client, url, prompt, OUT_TOKENS)
                got = sample.pop("request")["ids"]
                lost = sum(1 for a, b in zip(got, alone["ids"]) if a != b) + abs(len(alone["ids"]) - len(got))
                rows.append(dict(sample, context=context, lost_tokens=lost, restart_s=restart_s))
                print(json.dumps(rows[-1]), flush=True)
        stop.set()
        await load
    return rows


def gaps(model: str, args, vocab: int, log_dir: Path) -> dict:
    out = {}
    for mirror in args.gap_modes:
        s = server(model, mirror, log_dir, f"gap-{mirror}", *args.flags.split())
        try:
            rows = asyncio.run(gap_run(s.url, args, vocab, seed=11))
        finally:
            s.stop()
        out[mirror] = rows
    summary = {}
    med = lambda rows, k: statistics.median(r[k] for r in rows) if rows else None  # noqa: E731
    for context in args.contexts:
        on = [r for r in out.get("buddy", []) if r["context"] == context]
        off = [r for r in out.get("off", []) if r["context"] == context]
        summary[context] = {
            "gap_ms_mirror": med(on, "gap_ms"),
            "gap_ms_recompute": med(off, "gap_ms"),
            "gap_ratio": med(on, "gap_ms") / med(off, "gap_ms") if on and off else None,
            "token_gap_ms": med(on + off, "token_gap_ms"),
            "recomputed_mirror": med(on, "recomputed_tokens"),
            "recomputed_recompute": med(off, "recomputed_tokens"),
            "lost_tokens": sum(r["lost_tokens"] for r in on + off),
        }
        print(f"context {context}: {json.dumps(summary[context])}", flush=True)
    return {"samples": out, "summary": summary}


def add_lag_samples(into: dict[str, dict[int, int]], more: dict[str, dict[int, int]]) -> None:
    """Add lag samples {phase: {lag: count}} to `into`."""
    for phase, got in more.items():
        for k, n in got.items():
            into[phase][k] = into[phase].get(k, 0) + n


def steady_one(model: str, args, vocab: int, log_dir: Path, mirror: str, load: str, seed: int) -> dict:
    """One bench-serve run at `load` on a fresh server with mirroring `mirror`."""
    rate = ["--max-concurrency", load[1:]] if load.startswith("c") else ["--request-rate", load[1:]]
    common = ["--num-prompts", str(args.num_prompts), "--seed", str(seed), "--vocab-size", str(vocab)]
    stream_args = common + rate + ["--input-len", "256", "--output-len", "64", "--prompt-ids", "--ignore-eos"]
    name = f"steady-{mirror}-{load}-{seed}"
    s = server(model, mirror, log_dir, name, "--dispatch", "rr", *args.flags.split())
    try:
        r = bench(s.url, stream_args, log_dir / f"{name}.json")
        metrics = scrape(s.url)
        insts = httpx.get(s.url + "/admin/instances", timeout=30).json()["instances"]
    finally:
        s.stop()
    samples: dict[str, dict[int, int]] = {phase: {} for phase in LAG_PHASES}
    for inst in insts:
        add_lag_samples(samples, lag_samples(inst.get("kv_mirror")))
    step_s = metrics.get("dist_infer:step_duration_seconds_sum", 0.0)
    wait_s = metrics.get("dist_infer:kv_mirror_step_wait_seconds_total", 0.0)
    return {
        "req_s": r["request_throughput"],
        "ttft_p50_ms": r["ttft_ms"]["median"],
        "itl_p99_ms": r["itl_ms"]["p99"],
        "failed": r["failed"],
        "mirror_wait_share": wait_s / step_s if step_s else None,
        "lag_samples": samples,
        "blocks_sent": metrics.get("dist_infer:kv_mirror_blocks_sent_total", 0.0),
    }


def steady(model: str, args, vocab: int, log_dir: Path) -> dict:
    """Each load, mirroring on and off in turn (the order swapped each repeat), a new seed per pair;
    each figure's ratio as the median of the pairs' ratios (a pair's two runs share their prompts, and
    near saturation the seed moves TTFT more than mirroring does), and the ratio of the medians."""
    results: dict = {}
    for i, load in enumerate(args.steady.split(",")):
        runs: dict[str, list] = {"buddy": [], "off": []}
        for rep in range(args.steady_repeat):
            for mirror in ("buddy", "off") if rep % 2 == 0 else ("off", "buddy"):
                runs[mirror].append(steady_one(model, args, vocab, log_dir, mirror, load, 100 + 10 * i + rep))
                row = {k: v for k, v in runs[mirror][-1].items() if k != "lag_samples"}
                print(f"{mirror}@{load} #{rep}: {json.dumps(row)}", flush=True)
        med = {
            m: {k: statistics.median(r[k] for r in rs) for k in ("req_s", "ttft_p50_ms", "itl_p99_ms")}
            for m, rs in runs.items()
        }
        lag: dict[str, dict[int, int]] = {phase: {} for phase in LAG_PHASES}
        for r in runs["buddy"]:
            add_lag_samples(lag, r["lag_samples"])
        on, off = med["buddy"], med["off"]
        keys = {"req_s": "req_s", "ttft_p50": "ttft_p50_ms", "itl_p99": "itl_p99_ms"}
        results[load] = {
            "runs": runs,
            "ratios": {
                name: statistics.median(a[k] / b[k] for a, b in zip(runs["buddy"], runs["off"]))
                for name, k in keys.items()
            },
            "ratios_of_medians": {name: on[k] / off[k] for name, k in keys.items()},
            "mirror_wait_share": max(r["mirror_wait_share"] or 0 for r in runs["buddy"]),
            # the steady state ("output": blocks decodes filled) and a prompt's blocks before their first round
            "lag_blocks": {ph: {q: lag_quantile(lag[ph], q) for q in (0.5, 0.9, 0.95, 0.99)} for ph in lag},
        }
        summary = {k: v for k, v in results[load].items() if k != "runs"}
        print(f"{load}: {json.dumps(summary)}", flush=True)
    return results


async def chaos_run(url: str, args, vocab: int) -> dict:
    """Kills in a row under a stream (4 requests at a time, mixed lengths): each stream must end whole
    and equal its run alone."""
    rng = random.Random(7)
    failed = mismatched = done = 0
    migrations: Counter = Counter()
    async with httpx.AsyncClient() as client:
        for k in range(args.chaos):
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice((64, 256, 1024)))] for _ in range(4)]
            tasks = [asyncio.create_task(stream(client, url, p, OUT_TOKENS)) for p in prompts]
            await asyncio.sleep(rng.uniform(0.3, 1.0))
            insts = await instances(client, url)
            running = [(r, i["index"]) for i in insts if i["state"] == "serving" for r in i["running"]]
            if running:  # a live migration mid-stream (its request may end meanwhile: any outcome goes)
                request_id, src = rng.choice(running)
                moved = await client.post(
                    url + "/admin/migrate", json={"request_id": request_id, "to_instance": 1 - src}, timeout=120
                )
                migrations[moved.json().get("outcome", str(moved.status_code))] += 1
            await asyncio.sleep(rng.uniform(0.2, 1.0))
            victim = (await instances(client, url))[k % 2]
            for pid in victim["pids"]:
                os.kill(pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await seen_dead(client, url, victim["index"])  # (streams elsewhere may end before the death is seen)
            await restart(client, url, victim["index"])
            for prompt, got in zip(prompts, results):
                if isinstance(got, BaseException) or len(got["ids"]) != OUT_TOKENS:
                    failed += 1
                    continue
                alone = await stream(client, url, prompt, OUT_TOKENS)
                mismatched += got["ids"] != alone["ids"]
                done += 1
            print(
                f"kill {k + 1}/{args.chaos}: instance {victim['index']}; {done} whole so far, {failed} failed",
                flush=True,
            )
        metrics = scrape(url)
    return {
        "kills": args.chaos,
        "streams_whole": done,
        "failed": failed,
        "mismatched": mismatched,
        "requests_lost": metrics.get("dist_infer:requests_lost_total"),
        "migrations": dict(migrations),
        "failover_recomputed_tokens": metrics.get("dist_infer:kv_mirror_failover_recomputed_tokens_total"),
    }


def chaos(model: str, args, vocab: int, log_dir: Path) -> dict:
    s = server(model, "buddy", log_dir, "chaos", "--migrate-interval", "0.5", *args.flags.split())  # (later flags win)
    try:
        result = asyncio.run(chaos_run(s.url, args, vocab))
    finally:
        s.stop()
    print(f"chaos: {json.dumps(result)}", flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a checkpoint or GGUF, or 'default' (the built-in model)")
    p.add_argument("--contexts", default="1024,8000", help="gap: prompt lengths, comma-separated ('' skips)")
    p.add_argument("--gap-modes", default="buddy,off", help="gap: mirroring modes to run, comma-separated")
    p.add_argument("--repeat", type=int, default=3, help="gap: kills per context length and mode")
    p.add_argument("--kill-after", type=int, default=16, help="gap: tokens streamed before the kill (plus 0-15, drawn)")
    p.add_argument("--background", type=int, default=2, help="gap: background requests at a time")
    p.add_argument("--steady", default="c8", help="steady: loads (cN, rN), comma-separated ('' skips)")
    p.add_argument(
        "--num-prompts", type=int, default=200, help="steady: requests per run (fewer leave TTFT p50 to chance)"
    )
    p.add_argument("--steady-repeat", type=int, default=3, help="steady: on/off pairs per load")
    p.add_argument("--chaos", type=int, default=0, help="chaos: kills in a row (0 skips)")
    p.add_argument("--flags", default="", help="more flags for the server, e.g. '--prompt-dtype auto'")
    p.add_argument("--out", default=None, help="write the combined JSON here")
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    args.gap_modes = [m for m in args.gap_modes.split(",") if m]
    if not set(args.gap_modes) <= {"buddy", "off"}:
        p.error(f"--gap-modes: buddy and off only, got {args.gap_modes}")
    from dist_infer.models.builtin import resolve_model

    model = resolve_model(args.model)
    vocab = vocab_size(model)
    log_dir = Path(tempfile.mkdtemp(prefix="failover-"))
    print(f"uptime before: {os.getloadavg()}; logs in {log_dir}", flush=True)
    results: dict = {}
    if args.contexts:
        results["gap"] = gaps(model, args, vocab, log_dir)
    if args.steady:
        results["steady"] = steady(model, args, vocab, log_dir)
    if args.chaos:
        results["chaos"] = chaos(model, args, vocab, log_dir)
    print(f"uptime after: {os.getloadavg()}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

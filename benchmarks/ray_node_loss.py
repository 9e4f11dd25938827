"""A Ray node lost under a served request: how long until the moved request's next token,
and until the replacement instance serves.

Each trial starts a Ray cluster on this host (a head with no CPUs, three worker nodes of one CPU,
all on 127.0.0.1: ray.cluster_utils.Cluster), `dist-infer serve --placement ray --instances tp1,tp1
--dispatch rr` (one instance per node), streams two greedy requests (one per instance), and once
the one on instance 1 has 20 tokens removes instance 1's node. From that moment: the next token of
that request (it goes on on instance 0, prefilled again from its tokens so far), and instance 1
serving again (placed by --auto-restart on the free node). Medians over the trials.

    python benchmarks/ray_node_loss.py [--trials 5] [--model DIR] [--out FILE.json]

Only 127.0.0.1 is contacted. Check `uptime` before and after: figures count on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
LOCAL = "127.0.0.1"


def default_checkpoint(root: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / "node-loss-llama"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=128,
            hidden_size=256,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=1024,
        )
        LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def start_server(model: str, address: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    ready = workdir / f"ready-{time.monotonic_ns()}.json"
    log = open(workdir / "serve.log", "a")
    cmd = [
        str(BIN / "dist-infer"),
        "serve",
        "--model",
        model,
        "--instances",
        "tp1,tp1",
        "--dispatch",
        "rr",
        "--migrate-interval",
        "0",
        "--kv-blocks",
        "120",
        "--placement",
        "ray",
        "--ray-address",
        address,
        "--port",
        "0",
        "--ready-file",
        str(ready),
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"serve did not start; see {workdir / 'serve.log'}")
        time.sleep(0.2)
    return proc, f"http://{LOCAL}:{json.loads(ready.read_text())['port']}"


async def stream(client, url: str, prompt: list[int], on_token) -> list[float]:
    """Token arrival times of one greedy stream; on_token(count) after each event."""
    times, count = [], 0
    body = {"prompt": prompt, "stream": True, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            n = sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
            if n:
                count += n
                times.append(time.monotonic())
                await on_token(count)
    return times


def admin(url: str) -> list[dict]:
    return httpx.get(url + "/admin/instances", timeout=30).json()["instances"]


def trial(cluster, model: str, workdir: Path) -> dict:
    proc, url = start_server(model, cluster.address, workdir)
    try:
        lost = admin(url)[1]["node"]
        marks: dict = {}

        async def remove_at(count):
            if count >= 20 and "t0" not in marks:
                victim = next(n for n in cluster.list_all_nodes() if n.node_id == lost)
                marks["t0"] = time.monotonic()
                await asyncio.get_running_loop().run_in_executor(None, cluster.remove_node, victim)

        async def noop(_):
            return None

        async def go():
            async with httpx.AsyncClient() as client:
                first = asyncio.create_task(stream(client, url, [5, 6, 7, 8, 9, 10, 11, 12], noop))
                await asyncio.sleep(0.1)
                second = asyncio.create_task(stream(client, url, [13, 14, 15, 16, 17, 18], remove_at))
                return await first, await second

        _, moved = asyncio.run(go())
        t0 = marks["t0"]
        next_token = min(t for t in moved if t > t0) - t0
        while admin(url)[1]["state"] != "serving":
            if time.monotonic() - t0 > 120:
                raise SystemExit("the replacement instance did not serve within 120 s")
            time.sleep(0.05)
        replaced = time.monotonic() - t0
        return {"next_token_s": next_token, "replacement_serving_s": replaced}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from ray.cluster_utils import Cluster

    workdir = Path(tempfile.mkdtemp(prefix="dist-infer-node-loss-"))
    model = args.model or default_checkpoint(Path(tempfile.gettempdir()))
    results = []
    for i in range(args.trials):
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": LOCAL, "include_dashboard": False}
        )
        for _ in range(3):
            cluster.add_node(num_cpus=1, node_ip_address=LOCAL)
        cluster.wait_for_nodes()
        try:
            results.append(trial(cluster, model, workdir))
        finally:
            cluster.shutdown()
        print(f"trial {i + 1}: {json.dumps(results[-1])}", flush=True)
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(
        f"median over {len(results)} trials: next token of the moved request {med['next_token_s'] * 1e3:.0f} ms "
        f"after the node died; replacement instance serving after {med['replacement_serving_s']:.2f} s"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"trials": results, "median": med}, indent=1))


if __name__ == "__main__":
    main()

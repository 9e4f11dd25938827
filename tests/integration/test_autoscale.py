"""The SLO autoscaler (serve --autoscale MIN:MAX --slo ...) as a real server under a bursty
bench-serve stream (gamma arrivals, --burstiness 0.3): no request fails, the fleet grows during the
burst and shrinks after it, draining the instance it removes (whatever that instance holds moves
live: test_survival.py checks a drained instance's streams token by token), while two long greedy
streams run and end exactly as they do alone (= HF); nothing is lost."""

from __future__ import annotations

import asyncio
import json
import subprocess

import httpx

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf, prompts_for
from tests.support.paths import VENV_BIN
from tests.support.processes import venv_env
from tests.support.serving_helpers import (
    ServerJob,
    assert_live_blocks_free,
    instances,
    run_async,
    stream_tokens,
    wait_until,
)

LONG = 600
ROUNDS = 8  # pairs of streams at most while waiting for the scale-down


def _admin(job) -> dict:
    return httpx.get(job.url + "/admin/instances", timeout=30).json()


def _decisions(job, action: str) -> list[dict]:
    return [d for d in _admin(job)["autoscale"]["decisions"] if d["action"] == action and d["outcome"] == "done"]


def test_the_fleet_grows_in_a_burst_and_drains_live_after_it(tmp_path):
    checkpoint = write_hf_checkpoint(
        tmp_path,
        "llama-gqa",
        max_position_embeddings=1024,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1024,
        num_hidden_layers=4,
    )
    args = [
        "--model",
        checkpoint,
        "--autoscale",
        "1:2",
        "--slo",
        "ttft=0.3,tpot=1",
        "--autoscale-cooldown",
        "1.5",
        "--autoscale-down-after",
        "1.5",
        "--dispatch",
        "rr",
        "--migrate-interval",
        "0",
        "--kv-blocks",
        "200",
        "--timeout",
        "60",
    ]
    with ServerJob(tmp_path, args) as job:
        assert [i["state"] for i in instances(job)] == ["serving"], "MIN instances at start"
        bench = subprocess.run(
            [
                str(VENV_BIN / "dist-infer"),
                "bench-serve",
                "--url",
                job.url,
                "--num-prompts",
                "64",
                "--request-rate",
                "32",
                "--burstiness",
                "0.3",
                "--input-len",
                "512",
                "--max-input-len",
                "880",
                "--output-len",
                "32",
                "--prompt-ids",
                "--vocab-size",
                "128",
                "--ignore-eos",
                "--seed",
                "3",
                "--json",
                "--save-results",
                str(tmp_path / "bench.json"),
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env=venv_env(),
        )
        saved = (tmp_path / "bench.json").read_text() if (tmp_path / "bench.json").exists() else ""
        errors = [r.get("error") for r in json.loads(saved).get("requests", [])] if saved else []
        assert bench.returncode == 0, f"{[e for e in errors if e]}\n{job.log()[-5000:]}"
        result = json.loads(bench.stdout.strip().splitlines()[-1])
        assert result["completed"] == 64 and result.get("failed", 0) == 0, result
        ups = _decisions(job, "up")
        assert ups, (
            f"the burst was meant to pass the TTFT SLO: {_admin(job).get('autoscale')}; bench-serve: "
            f"{ {k: v for k, v in result.items() if 'ttft' in k or 'duration' in k} }"
        )
        wait_until(
            lambda: sum(i["state"] == "serving" for i in instances(job)) == 2,
            90,
            lambda: f"a second instance serving: {instances(job)}",
            interval=0.2,
        )

        prompts = prompts_for([14, 9], seed=81)

        async def streams():
            """The two streams, again until the fleet has shrunk during a pair of them (how many
            pairs that takes depends on how fast this machine decodes); then each alone."""
            async with httpx.AsyncClient() as client:
                for _ in range(ROUNDS):
                    tasks = [asyncio.create_task(stream_tokens(client, job.url, p, max_tokens=LONG)) for p in prompts]
                    await asyncio.sleep(0)
                    during = await asyncio.gather(*tasks)
                    if (
                        (await client.get(job.url + "/admin/instances", timeout=30))
                        .json()["autoscale"]["counts"]
                        .get("down")
                    ):
                        break
                alone = [await stream_tokens(client, job.url, p, max_tokens=LONG) for p in prompts]
                return during, alone

        during, alone = run_async(streams())
        downs = _decisions(job, "down")
        assert downs, f"the fleet was meant to shrink after the burst: {_admin(job)['autoscale']}"
        for d, a in zip(during, alone):
            assert d["error"] is None and d["token_ids"] == a["token_ids"] and len(d["token_ids"]) == LONG, (d, a)
        assert_ids_match_hf(checkpoint, prompts, [d["token_ids"] for d in during], 30, "autoscaled down mid-stream")
        stopped = downs[0]["instance"]
        wait_until(
            lambda: instances(job)[stopped]["state"] == "stopped",
            60,
            lambda: (
                f"instance {stopped} stopped after its drain: {instances(job)}; decisions: "
                f"{_admin(job)['autoscale']['decisions']}"
            ),
            interval=0.2,
        )
        metrics = job.metrics()
        assert metrics["dist_infer:requests_lost_total"] == 0 and metrics["dist_infer:instance_failures_total"] == 0
        assert metrics["dist_infer:autoscale_decisions_total"] >= 2, metrics
        assert f"draining instance {stopped}: its requests move" in job.log(), "a scale-down drains live"
        assert "autoscale up" in job.log() and "autoscale down" in job.log()
        assert_live_blocks_free(job)
        assert job.stop() == 0, job.log()[-4000:]

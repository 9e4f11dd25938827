"""Serving that survives, as real jobs over real HTTP on 127.0.0.1: an instance whose rank is
killed, an instance restarted, one stopped after draining and one added, and prefill/decode
split into instances of different tp sizes.

Every request either completes with exactly the tokens it has when it runs alone (which equal HF
transformers' greedy tokens; a near tie is the only excuse and is named), or is cancelled by its
own client; a request that was on an instance when it died streams on from another with no token
twice or missing; and every live instance ends with all its KV blocks free.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf, prompts_for
from tests.support.serving_helpers import (
    ServerJob,
    assert_all_blocks_free,
    assert_live_blocks_free,
    force_migrate,
    instances,
    kill_when_on,
    run_async,
    stream_tokens,
    wait_state,
    where,
)

LONG = 300  # tokens per request: long enough that a kill lands mid-decode
HF_CHECKED = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint(
        tmp_path_factory.mktemp("survive"),
        "llama-gqa",
        max_position_embeddings=2048,
        hidden_size=384,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1536,
        num_hidden_layers=4,
    )


def serve_again(job, count: int, timeout: float = 120.0) -> None:
    """Restart every instance that is dead until all `count` serve. The last kill of a chaos run
    may land just before it ends, and its instance is reported dead only once the API notices the
    closed connection: one look at the states can find it still serving, and never restart it."""
    deadline = time.monotonic() + timeout
    while True:
        insts = instances(job)
        if len(insts) == count and all(x["state"] == "serving" for x in insts):
            return
        for x in insts:
            if x["state"] == "dead":
                httpx.post(f"{job.url}/admin/instances/{x['index']}/restart", timeout=30)
        if time.monotonic() > deadline:
            raise AssertionError(f"not every instance serving after {timeout} s: {insts}\n{job.log()[-4000:]}")
        time.sleep(0.2)


def test_a_killed_instance_s_requests_stream_on_elsewhere_and_it_restarts(checkpoint, tmp_path):
    """Instance 1 (tp2) loses a rank (SIGKILL of its second rank, not its driver) while two greedy
    requests and a seeded sampled one stream from it: they go on on instance 0, prefilled again
    from the tokens their clients have, and end exactly as they do alone (greedy = HF). Instance 1
    is reported dead, is restarted over the admin API as a job of its own, rejoins, and a request
    moved to it ends exactly as alone too."""
    prompts = prompts_for([12, 30, 21, 17], seed=61)
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 4242}
    with ServerJob(
        tmp_path,
        [
            "--model",
            checkpoint,
            "--instances",
            "tp1,tp2",
            "--kv-blocks",
            "120",
            "--migrate-interval",
            "0",
            "--dispatch",
            "rr",
            "--timeout",
            "60",
        ],
    ) as job:
        victim = instances(job)[1]["pids"][1]

        async def go():
            async with httpx.AsyncClient() as client:
                killed: dict = {}
                kill_at = kill_when_on(job, 1, victim, 25, killed)  # rr: 1 and 3 (sampled) run on instance 1
                tasks = []
                for i, p in enumerate(prompts):
                    body = sampled if i == 3 else {}
                    tasks.append(
                        asyncio.create_task(stream_tokens(client, job.url, p, kill_at, max_tokens=LONG, **body))
                    )
                    await asyncio.sleep(0.1)
                chaos = await asyncio.gather(*tasks)
                alone = [
                    await stream_tokens(client, job.url, p, max_tokens=LONG, **(sampled if i == 3 else {}))
                    for i, p in enumerate(prompts)
                ]
                return killed, chaos, alone

        killed, chaos, alone = run_async(go())
        assert killed, "the kill never happened"
        for i, (c, a) in enumerate(zip(chaos, alone)):
            assert c["error"] is None and c["token_ids"] == a["token_ids"] and len(c["token_ids"]) == LONG, (i, c, a)
        assert_ids_match_hf(checkpoint, prompts[:3], [c["token_ids"] for c in chaos[:3]], HF_CHECKED, "after a kill")
        insts = instances(job)
        assert insts[1]["state"] == "dead" and insts[1]["dead"] and insts[0]["state"] == "serving", insts
        metrics = job.metrics()
        # Every request on instance 1 at the kill that had not ended by then is recovered: at least the
        # one whose stream triggered it; under load the other may already have ended on the server.
        assert 1 <= metrics["dist_infer:request_recovery_seconds_count"] <= killed["on_victim"], (killed, metrics)
        assert metrics["dist_infer:requests_lost_total"] == 0 and metrics["dist_infer:instance_failures_total"] == 1
        log = job.log()
        assert "go on on the other instances" in log and "streams again" in log, log[-4000:]

        r = httpx.post(job.url + "/admin/instances/1/restart", timeout=30)
        assert r.status_code == 202 and r.json()["state"] == "starting", r.text
        wait_state(job, 1, "serving")
        assert httpx.post(job.url + "/admin/instances/1/restart", timeout=30).status_code == 409  # it is serving

        async def after():
            async with httpx.AsyncClient() as client:
                out = {}

                async def move(request_id, n):
                    if n >= 5 and "r" not in out:
                        src = where(job, request_id)
                        out["r"] = await force_migrate(client, job.url, request_id, 1 - src)

                moved = await stream_tokens(client, job.url, prompts[1], move, max_tokens=LONG)
                return out["r"], moved

        r, moved = run_async(after())
        assert r.status_code == 200 and r.json()["outcome"] == "ok", r.text
        assert moved["token_ids"] == alone[1]["token_ids"]
        insts = instances(job)
        assert insts[1]["restarts"] == 1 and insts[1]["state"] == "serving", insts
        assert_all_blocks_free(job)
        assert job.stop() == 0, job.log()[-4000:]


def test_scale_down_drains_then_stops_and_scale_up_takes_new_load(checkpoint, tmp_path):
    """Three requests stream from two instances; the instance serving the second one is stopped:
    it drains (its requests move live to the other) and stops, and nothing is lost. Then one
    instance is added: it joins as instance 2 and takes the next request (the emptiest, by load).
    Which instance the second request lands on depends on when the first one's load was counted,
    so the test stops whichever it is rather than assuming instance 1."""
    prompts = prompts_for([14, 22, 9], seed=71)
    with ServerJob(
        tmp_path,
        [
            "--model",
            checkpoint,
            "--instances",
            "tp1,tp1",
            "--kv-blocks",
            "120",
            "--migrate-interval",
            "0",
            "--timeout",
            "60",
        ],
    ) as job:

        async def go():
            async with httpx.AsyncClient() as client:
                stopped = {}

                async def stop_at(request_id, n):
                    if n >= 10 and not stopped:
                        stopped["on"] = where(job, request_id)
                        stopped["r"] = await client.post(f"{job.url}/admin/instances/{stopped['on']}/stop", timeout=30)

                tasks = []
                for i, p in enumerate(prompts):
                    tasks.append(
                        asyncio.create_task(
                            stream_tokens(client, job.url, p, stop_at if i == 1 else None, max_tokens=LONG)
                        )
                    )
                    await asyncio.sleep(0.1)
                during = await asyncio.gather(*tasks)
                alone = [await stream_tokens(client, job.url, p, max_tokens=LONG) for p in prompts]
                return stopped, during, alone

        stopped, during, alone = run_async(go())
        assert stopped["r"].status_code == 202, stopped
        survivor = 1 - stopped["on"]
        for d, a in zip(during, alone):
            assert d["error"] is None and d["token_ids"] == a["token_ids"], (d, a)
        wait_state(job, stopped["on"], "stopped")
        assert job.metrics()["dist_infer:instance_failures_total"] == 0
        last = httpx.post(f"{job.url}/admin/instances/{survivor}/stop", timeout=30)
        assert last.status_code == 409, last.text  # the last one serving
        bad = httpx.post(job.url + "/admin/instances", json={"layout": "tp0"}, timeout=30)
        assert bad.status_code == 400 and "tp0" in bad.text, bad.text

        r = httpx.post(job.url + "/admin/instances", json={"layout": "tp1"}, timeout=30)
        assert r.status_code == 202 and r.json()["index"] == 2, r.text
        wait_state(job, 2, "serving")

        async def after():
            async with httpx.AsyncClient() as client:
                seen = {}

                def look(name):
                    async def on_token(request_id, n):
                        if n == 3:
                            seen[name] = where(job, request_id)

                    return on_token

                busy = asyncio.create_task(stream_tokens(client, job.url, prompts[0], look("busy"), max_tokens=800))
                await asyncio.sleep(0.3)
                new = await stream_tokens(client, job.url, prompts[2], look("new"), max_tokens=LONG)
                return seen, await busy, new

        seen, busy, new = run_async(after())
        assert {seen["busy"], seen["new"]} == {survivor, 2}, f"the new instance takes one of two requests: {seen}"
        assert busy["token_ids"][:LONG] == alone[0]["token_ids"] and new["token_ids"] == alone[2]["token_ids"]
        assert_live_blocks_free(job)
        assert job.stop() == 0, job.log()[-4000:]


def test_prefill_and_decode_instances_split_every_request(checkpoint, tmp_path):
    """prefill:tp2 hands each request to a decode:tp1 instance right after its first token (one
    stage, KV heads split across tp sizes); the tokens equal HF's and the mixed server's."""
    prompts = prompts_for([40, 25, 33, 18], seed=81)
    with ServerJob(
        tmp_path,
        [
            "--model",
            checkpoint,
            "--instances",
            "prefill:tp2,decode:tp1,decode:tp1",
            "--kv-blocks",
            "120",
            "--migrate-interval",
            "0",
            "--timeout",
            "60",
        ],
    ) as job:

        async def go():
            async with httpx.AsyncClient() as client:
                # LONG decodes: they still run when the later ones are handed over (to the less loaded decode
                # instance), however a busy machine spreads the prefills out
                return await asyncio.gather(*(stream_tokens(client, job.url, p, max_tokens=LONG) for p in prompts))

        out = run_async(go())
        assert [len(o["token_ids"]) for o in out] == [LONG] * 4
        assert_ids_match_hf(checkpoint, prompts, [o["token_ids"] for o in out], HF_CHECKED, "prefill/decode")
        metrics = job.metrics()
        assert metrics["dist_infer:migrations_total"] >= 4, metrics
        log = job.log()
        assert log.count("(pd): ") >= 4 and "-> 1 (pd)" in log and "-> 2 (pd)" in log, log[-4000:]
        insts = instances(job)
        assert [i["role"] for i in insts] == ["prefill", "decode", "decode"], insts
        assert_all_blocks_free(job)
        assert job.stop() == 0, job.log()[-4000:]


CHAOS_SEED = 2026


def test_chaos_every_request_completes_exactly_or_was_cancelled(checkpoint, tmp_path):
    """A seeded schedule of forced migrations, client cancels, instance kills (SIGKILL of a rank)
    and restarts under a stream of greedy and seeded sampled requests, with a bench-serve stream
    beside it: every request that its client did not cancel completes with exactly the tokens it
    has alone, none fails (ours, bench-serve's), and every live instance's KV blocks are free again."""
    import random
    import subprocess

    from tests.support.processes import venv_env
    from tests.support.serving_helpers import DIST

    rng = random.Random(CHAOS_SEED)
    n = 20
    prompts = prompts_for([rng.randint(5, 40) for _ in range(n)], seed=CHAOS_SEED)
    lengths = [rng.randint(40, 160) for _ in range(n)]
    bodies = [
        {
            "max_tokens": lengths[i],
            **({"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i} if rng.random() < 0.3 else {}),
        }
        for i in range(n)
    ]
    cancel_after = {i: rng.randint(3, 30) for i in rng.sample(range(n), 4)}
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(8.0)
        arrivals.append(t)
    with ServerJob(
        tmp_path,
        [
            "--model",
            checkpoint,
            "--instances",
            "tp1,tp1,tp1",
            "--kv-blocks",
            "120",
            "--migrate-interval",
            "0.5",
            "--migration-timeout",
            "10",
            "--timeout",
            "60",
        ],
    ) as job:

        async def references():
            async with httpx.AsyncClient() as client:
                return [await stream_tokens(client, job.url, p, **b) for p, b in zip(prompts, bodies)]

        alone = run_async(references())
        bench = subprocess.Popen(
            DIST
            + [
                "bench-serve",
                "--url",
                job.url,
                "--num-prompts",
                "40",
                "--request-rate",
                "10",
                "--prompt-ids",
                "--vocab-size",
                "128",
                "--input-len",
                "24",
                "--output-len",
                "48",
                "--seed",
                str(CHAOS_SEED),
                "--ignore-eos",
                "--json",
            ],
            env=venv_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        events: list[str] = []

        async def chaos():
            async with httpx.AsyncClient() as client:

                async def one(i):
                    await asyncio.sleep(arrivals[i])

                    async def maybe_cancel(request_id, k):
                        if i in cancel_after and k >= cancel_after[i]:
                            raise asyncio.CancelledError  # the client leaves mid-stream

                    try:
                        return await stream_tokens(client, job.url, prompts[i], maybe_cancel, **bodies[i])
                    except asyncio.CancelledError:
                        return {"cancelled": True}

                async def disorder():
                    act = random.Random(CHAOS_SEED + 1)
                    for _ in range(24):
                        await asyncio.sleep(act.uniform(0.1, 0.4))
                        insts = (await client.get(job.url + "/admin/instances", timeout=30)).json()["instances"]
                        dead = [x for x in insts if x["state"] == "dead"]
                        serving = [x for x in insts if x["state"] == "serving"]
                        choice = act.random()
                        if dead and choice < 0.35:
                            r = await client.post(f"{job.url}/admin/instances/{dead[0]['index']}/restart", timeout=30)
                            events.append(f"restart {dead[0]['index']}: {r.status_code}")
                        elif not dead and len(serving) == 3 and choice < 0.5:
                            victim = act.choice([x for x in serving if x["index"] != 0])  # 0 is in the API's process
                            os.kill(act.choice(victim["pids"]), signal.SIGKILL)
                            events.append(f"kill {victim['index']}")
                        else:
                            running = [(x["index"], r) for x in serving for r in x["requests"]]
                            if running and len(serving) > 1:
                                src, rid = act.choice(running)
                                dst = act.choice([x["index"] for x in serving if x["index"] != src])
                                r = await force_migrate(client, job.url, rid, dst)
                                events.append(f"migrate {src}->{dst}: {r.status_code}")

                stream = asyncio.gather(*(one(i) for i in range(n)))
                noise = asyncio.create_task(disorder())
                results = await stream
                await noise
                return results

        results = run_async(asyncio.wait_for(chaos(), 150))
        bench_out, _ = bench.communicate(timeout=120)
        assert any(e.startswith("kill") for e in events) and any(e.startswith("migrate") for e in events), events
        for i, (got, want) in enumerate(zip(results, alone)):
            if got.get("cancelled"):
                assert i in cancel_after
                continue
            assert got["error"] is None and got["token_ids"] == want["token_ids"], (i, bodies[i], events, got, want)
        summary = [line for line in bench_out.splitlines() if line.startswith("{")]
        assert bench.returncode == 0 and summary and '"failed": 0' in summary[-1], bench_out[-3000:]
        serve_again(job, 3)  # restart what is still down, so every instance ends up checked
        assert_live_blocks_free(job)
        metrics = job.metrics()
        assert metrics["dist_infer:requests_lost_total"] == 0, metrics
        print("chaos events:", events)
        assert job.stop() == 0, job.log()[-4000:]


def test_an_instance_joins_as_a_torchrun_job_of_its_own(checkpoint, tmp_path):
    """Under torchrun a dead rank ends the whole torchrun job, so each instance can be a job of its
    own: a tp2 torchrun job joins a running one-instance server with `serve --join` (hub address
    from the ready file, key from --hub-key-file), takes requests, is SIGKILLed mid-stream, and its
    request streams on from instance 0 with exactly the tokens it has alone."""
    import json
    import subprocess

    from tests.support.paths import VENV_BIN
    from tests.support.processes import venv_env

    key_file = tmp_path / "hub.key"
    prompts = prompts_for([16, 26], seed=91)
    with ServerJob(
        tmp_path,
        [
            "--model",
            checkpoint,
            "--kv-blocks",
            "120",
            "--migrate-interval",
            "0",
            "--dispatch",
            "rr",
            "--hub-key-file",
            str(key_file),
            "--timeout",
            "60",
        ],
    ) as job:
        hub = json.loads(job.ready_file.read_text())["hub"]
        assert key_file.stat().st_mode & 0o077 == 0, "the key file is private"
        log = open(tmp_path / "joined.log", "w")
        joined = subprocess.Popen(
            [
                str(VENV_BIN / "torchrun"),
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "dist_infer",
                "serve",
                "--model",
                str(checkpoint),
                "--kv-blocks",
                "120",
                "--instances",
                "tp2",
                "--join",
                f"{hub[0]}:{hub[1]}",
                "--instance-index",
                "1",
                "--hub-key-file",
                str(key_file),
                "--timeout",
                "60",
            ],
            env=venv_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            inst = wait_state(job, 1, "serving")
            assert inst["layout"] == "tp=2" and len(inst["pids"]) == 2, inst

            async def go():
                async with httpx.AsyncClient() as client:
                    killed: dict = {}
                    kill_at = kill_when_on(job, 1, inst["pids"][1], 20, killed)  # rr: one of the two runs there
                    first = asyncio.create_task(stream_tokens(client, job.url, prompts[0], kill_at, max_tokens=LONG))
                    await asyncio.sleep(0.05)
                    second = await stream_tokens(client, job.url, prompts[1], kill_at, max_tokens=LONG)
                    alone = [await stream_tokens(client, job.url, p, max_tokens=LONG) for p in prompts[:2]]
                    return killed, [await first, second], alone

            killed, during, alone = run_async(go())
            assert killed.get("on") == 1, "neither stream was seen on instance 1 past 20 tokens"
            for d, a in zip(during, alone):
                assert d["error"] is None and d["token_ids"] == a["token_ids"], (d, a)
            assert joined.wait(60) != 0  # torchrun ended its job when a rank died
            assert instances(job)[1]["state"] == "dead"
            assert_live_blocks_free(job)
            assert job.stop() == 0, job.log()[-4000:]
        finally:
            if joined.poll() is None:
                os.killpg(joined.pid, signal.SIGKILL)
            log.close()

"""Prefix caching across instances, as real jobs over HTTP on 127.0.0.1 (two tp1 instances).

Cache-aware dispatch: once each of two prefixes has been computed on one instance, every later
request sharing it goes there, its prefix is not computed again (the instance's hit counter rises
by the prefix's tokens), its tokens are HF's, and every block is free (or cached, evictable) at the
end. Migration and failover: a request moved to an instance that caches its prefix is sent without
the prefix's blocks (a cold one sends them all); a request whose instance dies goes on where its
prefix is cached and computes only the rest; both end with the tokens they have alone (= HF)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf
from tests.support.serving_helpers import (
    ServerJob,
    assert_all_blocks_free,
    assert_live_blocks_free,
    force_migrate,
    instances,
    run_async,
    stream_tokens,
    wait_state,
    where,
)

PREFIX = 64  # 4 blocks of 16
FIRST = 300  # the first "a" streams this long: it still runs when "b" is placed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("prefix-dispatch"), "llama-gqa", max_position_embeddings=1024)


def hits_by_instance(job) -> dict[str, float]:
    out = {}
    for line in httpx.get(job.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("dist_infer:prefix_cache_hits_total{"):
            engine = line.split('engine="')[1].split('"')[0]
            out[engine] = float(line.rsplit(" ", 1)[1])
    return out


def test_requests_go_where_their_prefix_is_cached(checkpoint, tmp_path):
    """The first request of each prefix (sent together) spread over the instances; each later one
    (sent alone) finds its whole prefix cached where it lands: the hit counter of exactly one
    instance rises by the prefix's tokens, the same instance for the same prefix."""
    prefixes = {name: [3 + (i * (7 + k)) % 100 for i in range(PREFIX)] for k, name in enumerate("ab")}
    prompt = {(name, j): prefixes[name] + [103 + j, 110 + j, 117 + j] for name in "ab" for j in range(4)}
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
                # "b" starts once "a" streams, so that "a" runs (on instance 0) when "b" is placed: a busy
                # machine could otherwise place "b" after "a" ended, on the same (then as free) instance
                a_runs = asyncio.Event()

                async def started(request_id, n):
                    a_runs.set()

                a = asyncio.create_task(stream_tokens(client, job.url, prompt[("a", 0)], started, max_tokens=FIRST))
                await a_runs.wait()
                b = await stream_tokens(client, job.url, prompt[("b", 0)], max_tokens=40)
                first = [await a, b]
                later, homes = [], {}
                for j in range(1, 4):
                    for n in "ab":
                        before = hits_by_instance(job)
                        later.append(await stream_tokens(client, job.url, prompt[(n, j)], max_tokens=8))
                        deadline = time.monotonic() + 30
                        while True:  # the instance's counters come with its next load report
                            after = hits_by_instance(job)
                            rose = [e for e in after if after[e] - before.get(e, 0.0) >= PREFIX]
                            if rose or time.monotonic() > deadline:
                                break
                            await asyncio.sleep(0.05)
                        assert len(rose) == 1, (n, j, before, after)
                        homes.setdefault(n, set()).add(rose[0])
                return first, later, homes

        first, later, homes = run_async(go())
        assert len(homes["a"]) == 1 and len(homes["b"]) == 1 and homes["a"] != homes["b"], homes
        insts = instances(job)
        assert all(i["prefix_cache_hit_rate"] and i["prefix_index_blocks"] >= PREFIX // 16 for i in insts), insts
        assert_ids_match_hf(
            checkpoint, [prompt[(n, 0)] for n in "ab"], [r["token_ids"] for r in first], 40, "first of each prefix"
        )
        assert_ids_match_hf(
            checkpoint,
            [prompt[(n, j)] for j in range(1, 4) for n in "ab"],
            [r["token_ids"] for r in later],
            8,
            "later requests, prefix cached",
        )
        assert_all_blocks_free(job)
        assert job.stop() == 0, job.log()[-4000:]


def test_migration_sends_only_what_the_destination_lacks_and_failover_hits_the_cache(checkpoint, tmp_path):
    """rr dispatch, so the test says where things go: both instances compute prefix P first. A
    request on P moved mid-decode is sent without P's blocks (held there: `held_blocks`), a
    request on an uncached prefix with all of them. Then the instance running a request on P is
    killed: the request goes on on the other, whose hit counter rises by P's tokens."""
    P = [3 + (i * 11) % 97 for i in range(96)]  # 6 blocks of 16
    Q = [5 + (i * 13) % 89 for i in range(96)]
    tail = {name: [101 + k, 107 + k, 113 + k] for k, name in enumerate(("moved", "cold", "failover"))}
    prompt = {"moved": P + tail["moved"], "cold": Q + tail["cold"], "failover": P + tail["failover"]}
    with ServerJob(
        tmp_path,
        [
            "--model",
            checkpoint,
            "--instances",
            "tp1,tp1",
            "--kv-blocks",
            "200",
            "--dispatch",
            "rr",
            "--migrate-interval",
            "0",
            "--timeout",
            "60",
        ],
    ) as job:

        async def go():
            async with httpx.AsyncClient() as client:
                for k in range(2):  # P computed on each instance, in turn
                    await stream_tokens(client, job.url, P + [90 + k], max_tokens=2)
                moves = {}

                # each request acts at its first token and runs long after it: the client reads the
                # stream behind the server, so a later token could come after the request ended
                def move_at(name):
                    async def on_token(request_id, n):
                        if n >= 1 and name not in moves:
                            moves[name] = "pending"
                            moves[name] = await force_migrate(client, job.url, request_id, 1 - where(job, request_id))

                    return on_token

                streams = {
                    name: await stream_tokens(client, job.url, prompt[name], move_at(name), max_tokens=300)
                    for name in ("moved", "cold")
                }
                killed = {}

                async def kill_at(request_id, n):
                    if n >= 1 and not killed:
                        killed["instance"] = where(job, request_id)
                        killed["hits"] = hits_by_instance(job)
                        os.kill(instances(job)[killed["instance"]]["pids"][0], signal.SIGKILL)

                streams["failover"] = await stream_tokens(client, job.url, prompt["failover"], kill_at, max_tokens=300)
                alone = {
                    name: await stream_tokens(client, job.url, prompt[name], max_tokens=len(streams[name]["token_ids"]))
                    for name in prompt
                }
                return moves, streams, killed, alone

        moves, streams, killed, alone = run_async(go())
        moved, cold = (moves[name].json() for name in ("moved", "cold"))
        assert moved["outcome"] == "ok" and cold["outcome"] == "ok", (moved, cold)
        # P's blocks stay behind for the moved request; the cold one sends all of its own (how many
        # each had by then depends on how far it got: the client reads behind the server)
        assert moved["held_blocks"] == len(P) // 16 and cold["held_blocks"] == 0, (moved, cold)
        assert cold["blocks"] >= len(Q) // 16 + 1 and moved["blocks"] >= 1, (moved, cold)
        survivor = 1 - killed["instance"]
        wait_state(job, killed["instance"], "dead")
        hits = hits_by_instance(job)
        assert hits[str(survivor)] - killed["hits"].get(str(survivor), 0.0) >= len(P), (killed, hits)
        for name in prompt:
            s = streams[name]
            assert s["error"] is None and s["token_ids"] == alone[name]["token_ids"], (name, s, alone[name])
        assert_ids_match_hf(
            checkpoint,
            list(prompt.values()),
            [streams[n]["token_ids"][:40] for n in prompt],
            40,
            "moved with a held prefix, moved cold, failed over onto a cached prefix",
        )
        assert_live_blocks_free(job)

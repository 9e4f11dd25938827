"""Prefix-cache isolation on a real serve job (two tp1 instances, cache-aware dispatch) over HTTP on
127.0.0.1, with two API keys, so --prefix-cache-isolation defaults to `key`, and --protect-metrics.

Alice's prompt is cached where it ran; Bob's identical prompt finds none of it (no instance's hit
counter rises), Alice's next one finds all of it (the instance's counter rises by the prefix's
tokens, and dispatch, hashing with her salt, sent it there); a cache_salt under Bob's key reaches
none of Alice's blocks either. Every answer has the same tokens: isolation changes what is
computed again, never what comes out. /metrics needs a key and shows the counters."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.serving_helpers import ServerJob, assert_all_blocks_free, run_async, stream_tokens

PREFIX = 64  # 4 blocks of 16
KEYS = {"alice": "key-alice", "bob": "key-bob"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("isolation"), "llama-gqa", max_position_embeddings=1024)


def counters(job, key: str) -> tuple[float, float]:
    """(queried, hit) tokens of every instance's prefix cache, summed (the metrics need a key:
    --protect-metrics, under which they are shown)."""
    text = httpx.get(job.url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    sums = {}
    for name in ("queries", "hits"):
        rows = [line for line in text.splitlines() if line.startswith(f"dist_infer:prefix_cache_{name}_total{{")]
        assert rows, f"prefix_cache_{name} is shown under --protect-metrics"
        sums[name] = sum(float(line.rsplit(" ", 1)[1]) for line in rows)
    return sums["queries"], sums["hits"]


async def hit_of_next_request(job, key: str, prompt: list[int], **body) -> tuple[float, list[int]]:
    """Stream one request with `key`; (the prefix tokens it found cached, its tokens). An instance
    counts a request's queried and hit tokens together at its admission and reports both with its
    load: once the queries show this request, its hits are in too."""
    queried, hit = counters(job, key)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}) as client:
        out = await stream_tokens(client, job.url, prompt, max_tokens=8, **body)
    for _ in range(300):
        now_queried, now_hit = counters(job, key)
        if now_queried >= queried + len(prompt):
            return now_hit - hit, out["token_ids"]
        await asyncio.sleep(0.05)
    raise AssertionError(f"the instances never reported the request ({queried} -> {now_queried} queried tokens)")


def test_one_keys_cached_prompt_is_no_hit_for_another_key(checkpoint, tmp_path):
    prompt = [3 + (i * 7) % 100 for i in range(PREFIX)] + [101, 102, 103]
    args = [
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
        "--protect-metrics",
    ]
    for key in KEYS.values():
        args += ["--api-key", key]
    with ServerJob(tmp_path, args) as job:
        assert httpx.get(job.url + "/metrics", timeout=30).status_code == 401

        async def go():
            return [
                await hit_of_next_request(job, KEYS[who], prompt, **body)
                for who, body in (("alice", {}), ("bob", {}), ("bob", {"cache_salt": "x"}), ("alice", {}))
            ]

        got = run_async(go())
        rises, outputs = [r for r, _ in got], [o for _, o in got]
        assert rises[:3] == [0, 0, 0] and rises[3] == PREFIX, rises
        assert all(o == outputs[0] and len(o) == 8 for o in outputs), outputs
        assert_all_blocks_free(job)
        assert job.stop() == 0, job.log()[-4000:]

"""Cache-aware dispatch as a real job over HTTP on 127.0.0.1: two instances, two prompt prefixes.
Once each prefix has been computed on one instance, every later request sharing it goes there,
its prefix is not computed again (the instance's hit counter rises by the prefix's tokens), its
tokens are HF's, and every block is free (or cached, evictable) at the end."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from checkpoints import write_hf_checkpoint
from hf_compare import assert_ids_match_hf
from serving_helpers import ServerJob, assert_all_blocks_free, instances, run_async, stream_tokens

PREFIX = 64  # 4 blocks of 16


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
    with ServerJob(tmp_path, ["--model", checkpoint, "--instances", "tp1,tp1", "--kv-blocks", "120",
                              "--migrate-interval", "0", "--timeout", "60"]) as job:
        async def go():
            async with httpx.AsyncClient() as client:
                first = await asyncio.gather(*(stream_tokens(client, job.url, prompt[(n, 0)], max_tokens=40)
                                               for n in "ab"))
                later, homes = [], {}
                for j in range(1, 4):
                    for n in "ab":
                        before = hits_by_instance(job)
                        later.append(await stream_tokens(client, job.url, prompt[(n, j)], max_tokens=8))
                        for _ in range(50):  # the instance's counters come with its next load report
                            after = hits_by_instance(job)
                            rose = [e for e in after if after[e] - before.get(e, 0.0) >= PREFIX]
                            if rose:
                                break
                            await asyncio.sleep(0.05)
                        assert len(rose) == 1, (n, j, before, after)
                        homes.setdefault(n, set()).add(rose[0])
                return first, later, homes

        first, later, homes = run_async(go())
        assert len(homes["a"]) == 1 and len(homes["b"]) == 1 and homes["a"] != homes["b"], homes
        insts = instances(job)
        assert all(i["prefix_cache_hit_rate"] and i["prefix_index_blocks"] >= PREFIX // 16 for i in insts), insts
        assert_ids_match_hf(checkpoint, [prompt[(n, 0)] for n in "ab"], [r["token_ids"] for r in first], 40,
                            "first of each prefix")
        assert_ids_match_hf(checkpoint, [prompt[(n, j)] for j in range(1, 4) for n in "ab"],
                            [r["token_ids"] for r in later], 8, "later requests, prefix cached")
        assert_all_blocks_free(job)
        assert job.stop() == 0, job.log()[-4000:]

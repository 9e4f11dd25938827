"""KV mirroring (--kv-mirror buddy) in a real `dist-infer serve` with a tp1 and a tp2 (or a pp2)
instance: each mirrors its running requests' KV blocks to the other. A request whose instance is
SIGKILLed mid-decode goes on at the buddy from the mirrored blocks (a prefix-cache hit there): the tokens it
computes again are only the unmirrored tail, a fraction of what the recompute path computes, and
its stream ends with exactly the ids it has alone (greedy and seeded sampling; from one layout
to the other). A live migration to the buddy sends nothing already mirrored. Every KV block of the
survivor comes back once the requests end (leases released).

The kill waits, bounded, until the victim's mirror has caught up with the prompt; the test never
depends on how fast that happens, only on that it happens. The client reads a stream behind the
server: a request may end before its mirror is seen caught up; such a round runs again, at most
three times.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from tests.support.serving_helpers import (
    ServerJob,
    assert_live_blocks_free,
    ended_first,
    force_migrate,
    instances,
    kill_when_on,
    run_async,
    stream_tokens,
    where_if_running,
)
from tests.support.structured_checkpoints import write_structured_checkpoint

PROMPT = [(7 * i + 3) % 1000 + 2 for i in range(160)]  # 20 blocks of 8


def prompt(attempt: int) -> list[int]:
    """A prompt of its own per attempt: no attempt finds another's blocks in a prefix cache."""
    return [(t + 97 * attempt) % 1000 + 2 for t in PROMPT]


SAMPLED = {"temperature": 0.5, "top_k": 2, "seed": 11}
BLOCK = 8
MAX_TOKENS = 600  # long enough that the mirror is seen caught up while the request still runs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_structured_checkpoint(tmp_path_factory.mktemp("kv-mirror"), max_positions=1024)


def serve_args(checkpoint, *extra: str, layouts: str = "tp1,tp2") -> list[str]:
    return [
        "--model",
        str(checkpoint),
        "--instances",
        layouts,
        "--block-size",
        str(BLOCK),
        "--kv-blocks",
        "400",
        "--migrate-interval",
        "0",
        "--dispatch",
        "rr",
        "--timeout",
        "60",
        "--kv-mirror",
        "buddy",
        *extra,
    ]


async def mirrored(client, url: str, source: int, request_id: str, blocks: int, tails: int = 0, timeout: float = 120.0):
    """Wait (bounded) until `source`'s buddy holds at least `blocks` of its blocks from committed
    rounds (and `tails` partial blocks): /admin/instances then; None if the request ended first. (Not for the lag to be
    nil: this tiny model fills a block in a few steps, faster than rounds come.)"""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        insts = (await client.get(url + "/admin/instances", timeout=30)).json()["instances"]
        if request_id not in insts[source]["requests"]:
            return None
        buddy = insts[source]["kv_mirror_buddy"]
        there = (insts[buddy]["kv_mirror"] or {}) if buddy is not None else {}
        if there.get("committed_blocks", 0) >= blocks and there.get("tails", 0) >= tails:
            return {"buddy": buddy, "held": there["committed_blocks"], "instances": insts}
        assert asyncio.get_running_loop().time() < deadline, f"the mirror never caught up: {insts}"
        await asyncio.sleep(0.05)


def kill_all(pids) -> None:
    """SIGKILL an instance's ranks (one dying may take the others down first)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stream_and_kill(job, tokens: list[int], tails: int = 0, **body) -> tuple[dict, dict]:
    """Stream `tokens`; after 8 tokens, once its instance's buddy holds the prompt's blocks (and
    `tails` partial blocks), SIGKILL that instance. (The stream, and what was killed: without
    "tokens" if the request ended first.)"""
    killed: dict = {}

    async def go():
        async with httpx.AsyncClient() as client:

            async def kill(request_id, n):
                if n >= 8 and not killed:
                    killed["on"] = victim = where_if_running(job, request_id)
                    seen = None
                    if victim is not None:
                        seen = await mirrored(client, job.url, victim, request_id, len(tokens) // BLOCK, tails)
                    if seen is not None:
                        killed.update(seen, tokens=len(tokens) + n)
                        kill_all(seen["instances"][victim]["pids"])

            return await stream_tokens(client, job.url, tokens, kill, max_tokens=MAX_TOKENS, **body)

    return run_async(go()), killed


def recomputed(job) -> float:
    return job.metrics()["dist_infer:kv_mirror_failover_recomputed_tokens_total"]


@pytest.mark.parametrize(
    ("layouts", "body"),
    [("tp1,tp2", {}), ("tp1,tp2", SAMPLED), ("pp2,tp1", {})],
    ids=["tp-greedy", "tp-sampled", "pp-greedy"],
)
def test_a_request_whose_instance_dies_goes_on_from_its_mirror_exactly(checkpoint, tmp_path, layouts, body):
    """Its instance (either layout, wherever dispatch put it) dies; it goes on at the other layout."""
    with ServerJob(tmp_path, serve_args(checkpoint, layouts=layouts)) as job:
        for attempt in range(3):
            chaos, killed = stream_and_kill(job, prompt(attempt), **body)
            if "tokens" in killed:
                break
        else:
            pytest.fail(f"three rounds in a row ended before their mirror was seen caught up: {killed}")
        assert chaos["error"] is None and len(chaos["token_ids"]) == MAX_TOKENS, chaos
        metrics = job.metrics()
        assert metrics["dist_infer:requests_lost_total"] == 0
        assert metrics["dist_infer:request_recovery_seconds_count"] >= 1
        again = recomputed(job)
        # the prompt's blocks were mirrored before the kill: the recompute is the tail (what decoded
        # since), never the context (the path without a mirror computes at least the prompt again)
        assert 0 < again < len(PROMPT), (again, killed["on"], killed["tokens"])
        alone = run_async(_alone(job, prompt(attempt), body))
        assert chaos["token_ids"] == alone["token_ids"], "the failed-over request's ids differ from its run alone"
        assert_live_blocks_free(job)
        leased = [i["kv_mirror"]["leased_blocks"] for i in instances(job) if i["state"] == "serving"]
        assert leased == [0], f"a lease outlived its request: {leased}"


async def _alone(job, tokens: list[int], body) -> dict:
    async with httpx.AsyncClient() as client:
        return await stream_tokens(client, job.url, tokens, max_tokens=MAX_TOKENS, **body)


def test_without_a_mirror_the_survivor_recomputes_the_whole_context(checkpoint, tmp_path):
    """The baseline the mirror beats, on the same stream: the whole context computed again."""
    args = [a if a != "buddy" else "off" for a in serve_args(checkpoint)]
    with ServerJob(tmp_path, args) as job:
        pids = instances(job)[0]["pids"]
        for attempt in range(3):  # a round whose request ran on instance 1 (rr skipped a turn) runs again
            killed: dict = {}
            tokens = prompt(attempt)

            async def go():
                async with httpx.AsyncClient() as client:
                    kill = kill_when_on(job, 0, pids, 8, killed)
                    return await stream_tokens(client, job.url, tokens, kill, max_tokens=MAX_TOKENS)

            chaos = run_async(go())
            if killed:
                break
        else:
            pytest.fail("three rounds in a row ran on instance 1")
        assert chaos["error"] is None and len(chaos["token_ids"]) == MAX_TOKENS, chaos
        assert recomputed(job) >= len(tokens) + killed["at"] - 1, killed


def test_a_migration_to_the_buddy_sends_only_what_is_not_mirrored(checkpoint, tmp_path):
    with ServerJob(tmp_path, serve_args(checkpoint)) as job:
        for attempt in range(3):
            moves: list = []

            async def go():
                async with httpx.AsyncClient() as client:

                    async def move(request_id, n):
                        if n >= 8 and not moves:
                            src = where_if_running(job, request_id)
                            seen = None
                            if src is not None:
                                seen = await mirrored(client, job.url, src, request_id, len(PROMPT) // BLOCK)
                            moves.append(
                                None if seen is None else await force_migrate(client, job.url, request_id, 1 - src)
                            )

                    moved = await stream_tokens(client, job.url, prompt(attempt), move, max_tokens=MAX_TOKENS)
                    alone = await stream_tokens(client, job.url, prompt(attempt), max_tokens=MAX_TOKENS)
                    return moved, alone

            moved, alone = run_async(go())
            assert moved["token_ids"] == alone["token_ids"]
            if moves and not ended_first(moves[0]):
                break
        else:
            pytest.fail("three rounds in a row ended before their mirror was seen caught up")
        r = moves[0]
        assert r.status_code == 200 and r.json()["outcome"] == "ok", r.text
        result = r.json()
        assert result["held_blocks"] >= len(PROMPT) // BLOCK, result
        assert result["blocks"] < result["held_blocks"], f"sent what the buddy held already: {result}"
        assert_live_blocks_free(job)


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    return write_structured_checkpoint(tmp_path_factory.mktemp("kv-mirror-long"), max_positions=4096)


def test_a_long_request_goes_on_from_its_mirrored_partial_block(long_checkpoint, tmp_path):
    """Past LONG_REQUEST_TOKENS the partial last block is mirrored too: the failover runs on from it
    (the buddy takes the request over with the blocks, as a migration's commit does), exactly."""
    from dist_infer.engine.mirror.entries import LONG_REQUEST_TOKENS

    long_prompt = [(5 * i + 1) % 1000 + 2 for i in range(LONG_REQUEST_TOKENS + 3 * BLOCK + 3)]
    args = [a if a != "400" else "1200" for a in serve_args(long_checkpoint)]  # --kv-blocks: two long mirrors
    with ServerJob(tmp_path, args) as job:
        for attempt in range(3):
            tokens = [(t + 31 * attempt) % 1000 + 2 for t in long_prompt]
            chaos, killed = stream_and_kill(job, tokens, tails=1)
            if "tokens" in killed:
                break
        else:
            pytest.fail(f"three rounds in a row ended before their mirror was seen caught up: {killed}")
        assert chaos["error"] is None and len(chaos["token_ids"]) == MAX_TOKENS, chaos
        buddy = instances(job)[killed["buddy"]]
        assert buddy["kv_mirror"]["tails_taken_over"] == 1, buddy["kv_mirror"]
        # what decoded since the last round is computed again (a few steps of this tiny model), never the context
        assert recomputed(job) < len(tokens) // 8, recomputed(job)
        alone = run_async(_alone(job, tokens, {}))
        assert chaos["token_ids"] == alone["token_ids"], "the failed-over request's ids differ from its run alone"
        assert_live_blocks_free(job)

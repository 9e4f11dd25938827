"""Structured requests that move: a JSON-schema request streamed from a real `dist-infer serve`
with a tp1 and a tp2 instance is migrated live mid-decode (each way), and another loses its
instance (a rank SIGKILLed) mid-decode and streams on from the other. Each ends with exactly the
ids it has when it runs alone, and its text validates: the grammar state was rebuilt from the ids
on the destination.

The client reads a stream behind the server: on a loaded machine a request may end before the
move asked at its first tokens arrives (the move then finds nothing, and the stream is whole). Such
a round runs again with a new prompt, at most three times.
"""

from __future__ import annotations

import json
import os
import signal

import httpx
import jsonschema
import pytest

from tests.support.serving_helpers import (
    ServerJob,
    assert_live_blocks_free,
    ended_first,
    force_migrate,
    instances,
    run_async,
    stream_tokens,
    where_if_running,
)
from tests.support.structured_checkpoints import write_structured_checkpoint

# a long constrained answer (several hundred tokens), so a move lands mid-decode
LIST = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 200, "maxItems": 200}
PROMPTS = ["Numbers:", "A list of integers:", "Counts:", "Values, in order:"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_structured_checkpoint(tmp_path_factory.mktemp("structured-moves"), max_positions=2048)


def serve_args(checkpoint) -> list[str]:
    return ["--model", str(checkpoint), "--instances", "tp1,tp2", "--block-size", "8", "--kv-blocks", "400"] + [
        "--migrate-interval",
        "0",
        "--dispatch",
        "rr",
        "--timeout",
        "60",
    ]


def check_valid(checkpoint, ids: list[int]) -> None:
    from dist_infer.engine.tokenizer import TextTokenizer

    text = TextTokenizer(checkpoint).decode(ids)
    jsonschema.validate(json.loads(text), LIST)


def test_a_structured_request_migrated_there_and_back_mid_decode_ends_as_alone(checkpoint, tmp_path):
    """Moved at its 2nd token to the other instance and at its 12th back: tp1 -> tp2 -> tp1 or the reverse."""
    with ServerJob(tmp_path, serve_args(checkpoint)) as job:
        for prompt in PROMPTS[:3]:
            moves: list = []

            async def go():
                async with httpx.AsyncClient() as client:

                    async def move(request_id, n):
                        if (n >= 2 and not moves) or (n >= 12 and len(moves) == 1 and not ended_first(moves[0][1])):
                            src = where_if_running(job, request_id)
                            r = None if src is None else await force_migrate(client, job.url, request_id, 1 - src)
                            moves.append((src, r))

                    moved = await stream_tokens(client, job.url, prompt, move, guided_json=LIST, max_tokens=1500)
                    alone = await stream_tokens(client, job.url, prompt, guided_json=LIST, max_tokens=1500)
                    return moved, alone

            moved, alone = run_async(go())
            if not any(ended_first(r) for _, r in moves):
                break
            assert moved["token_ids"] == alone["token_ids"], "a request that ended first is whole"
        else:
            pytest.fail("three rounds in a row ended before their moves arrived")
        assert [src for src, _ in moves] in ([0, 1], [1, 0]), moves
        for _, r in moves:
            assert r.status_code == 200 and r.json()["outcome"] == "ok", r.text
        assert moved["error"] is None and moved["finish_reason"] == "stop", moved
        assert moved["token_ids"] == alone["token_ids"], "the moved request's ids differ from its run alone"
        check_valid(checkpoint, moved["token_ids"])
        assert_live_blocks_free(job)
        started = job.metrics()["dist_infer:structured_matchers_started_total"]
        assert started >= 4, f"a grammar state made at each arrival: {started}"


def test_a_structured_request_whose_instance_dies_streams_on_elsewhere_as_alone(checkpoint, tmp_path):
    with ServerJob(tmp_path, serve_args(checkpoint)) as job:
        victim = instances(job)[1]["pids"][1]  # the tp2 instance's second rank
        for prompt in PROMPTS[:3]:
            killed: dict = {}

            async def go():
                async with httpx.AsyncClient() as client:

                    async def kill(request_id, n):
                        if n >= 2 and not killed:
                            killed["on"] = where_if_running(job, request_id)
                            if killed["on"] == 1:
                                os.kill(victim, signal.SIGKILL)

                    await stream_tokens(client, job.url, "warm", max_tokens=2)  # rr: the next one goes to instance 1
                    chaos = await stream_tokens(client, job.url, prompt, kill, guided_json=LIST, max_tokens=1500)
                    alone = await stream_tokens(client, job.url, prompt, guided_json=LIST, max_tokens=1500)
                    return chaos, alone

            chaos, alone = run_async(go())
            if killed.get("on") == 1:
                break
        else:
            pytest.fail(f"three rounds in a row never killed the request's instance mid-decode: {killed}")
        assert chaos["error"] is None and chaos["finish_reason"] == "stop", chaos
        assert chaos["token_ids"] == alone["token_ids"], "the failed-over request's ids differ from its run alone"
        check_valid(checkpoint, chaos["token_ids"])
        metrics = job.metrics()
        assert (
            metrics["dist_infer:request_recovery_seconds_count"] >= 1 and metrics["dist_infer:requests_lost_total"] == 0
        )
        assert_live_blocks_free(job)

"""Live migration between serving instances, as real jobs over real HTTP on 127.0.0.1.

One job serves a tp2 and a tp1 instance of the same random checkpoint (3 ranks). Requests that
are moved mid-decode, at random points and both ways (tp2 -> tp1 and back), stream on without a
break and produce exactly the tokens they produce unmoved, which equal HF transformers' (a near
tie is the only excuse, and the assertion names it); a seeded sampled request continues
bit-identically; a prompt moves between its prefill chunks. Then the abort paths (no room on the
destination, a destination that stops answering, a client that leaves mid-migration) and draining
an instance. Separate jobs move requests between a pp2 and a tp1 instance, and over MPI. After each
test every instance has all its KV blocks free again. (Instances that die, restart, stop, start and
split prefill from decode: tests/integration/test_survival.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import httpx
import pytest

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf, prompts_for
from tests.support.serving_helpers import (
    ServerJob,
    assert_all_blocks_free,
    ended_first,
    force_migrate,
    instances,
    run_async,
    stream_tokens,
    where,
    where_if_running,
)

LONG = 400  # tokens per request: long enough that a forced migration lands mid-decode
HF_CHECKED = 40  # tokens compared with HF (the migration points are within them)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # wide enough that a decode step takes a millisecond or two, so a request of LONG tokens is still
    # decoding when a migration forced at its first tokens has done its stages
    return write_hf_checkpoint(
        tmp_path_factory.mktemp("migrate"),
        "llama-gqa",
        max_position_embeddings=2048,
        hidden_size=384,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1536,
        num_hidden_layers=4,
    )


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    job = ServerJob(
        tmp_path_factory.mktemp("migrate-serve"),
        [
            "--model",
            checkpoint,
            "--instances",
            "tp2,tp1",
            "--block-size",
            "16",
            "--kv-blocks",
            "120",
            "--max-batched-tokens",
            "64",
            "--migrate-interval",
            "0",
            "--migration-timeout",
            "4",
            "--timeout",
            "60",
        ],
    )
    yield job
    if job.proc.poll() is None:
        job.kill()


def test_migrated_requests_equal_unmigrated_and_hf_across_tp_sizes(server, checkpoint):
    """Four requests each moved once mid-decode (one of them back again), between a tp2 and a tp1
    instance, end exactly as unmoved. The client reads a stream behind the server: on a loaded
    machine a request can end before the move asked at its n-th token arrives (404, and the
    stream is then whole); such a round is run again with new prompts, at most three times."""
    for attempt in range(3):
        missed, moved, alone, moves, prompts = _migrate_round(server, seed=12 + attempt)
        if not missed:
            break
        for i in missed:  # a move missed only because its request had ended: complete, as alone
            assert moved[i]["token_ids"] == alone[i]["token_ids"] and len(moved[i]["token_ids"]) == LONG, moved[i]
    else:
        pytest.fail(f"three rounds in a row had a move land after its request ended: {missed}")
    for i, (m, a) in enumerate(zip(moved, alone)):
        assert len(m["token_ids"]) == LONG and m["finish_reason"] == "length", m
        assert m["token_ids"] == a["token_ids"], f"prompt {i}: migrated output differs from the unmigrated one"
    assert len(moves) == len(prompts) + 1
    assert {(src, dst) for _, src, dst, _ in moves} == {(0, 1), (1, 0)}, "both tp2 -> tp1 and tp1 -> tp2"
    for _, _, _, res in moves:
        assert res["outcome"] == "ok" and res["blocks"] >= 1 and res["downtime_s"] > 0, res
    assert_all_blocks_free(server)
    assert_ids_match_hf(checkpoint, prompts, [m["token_ids"] for m in moved], HF_CHECKED, "migrated")
    metrics = server.metrics()
    assert metrics["dist_infer:migrations_total"] >= len(moves)
    assert metrics["dist_infer:migration_downtime_seconds_count"] >= len(moves)


def _migrate_round(server, seed: int):
    """One round: the requests of `seed`, streamed and moved, then each alone. Returns the
    requests whose move came after they ended, the moved and alone outputs, the moves, the prompts."""
    rng = random.Random(seed)
    prompts = prompts_for([rng.randint(5, 40) for _ in range(4)], seed=seed)
    # request i moves after `points[i]` tokens; request 0 moves back after `back` more (tp2 -> tp1 -> tp2 or reverse)
    points = [rng.randint(1, 12) for _ in prompts]
    back = rng.randint(5, 15)
    moves: list = []
    missed: list[int] = []

    async def go():
        async with httpx.AsyncClient() as client:

            async def movedstream_tokens(i):
                state = {"moves": 0}

                async def on_token(request_id, n):
                    due = points[i] if state["moves"] == 0 else points[i] + back
                    if n >= due and state["moves"] < (2 if i == 0 else 1) and i not in missed:
                        state["moves"] += 1
                        src = where_if_running(server, request_id)
                        r = None if src is None else await force_migrate(client, server.url, request_id, 1 - src)
                        if ended_first(r):
                            missed.append(i)  # it ended on the server first; its stream shows it whole
                            return
                        assert r.status_code == 200, r.text
                        moves.append((i, src, 1 - src, r.json()))

                return await stream_tokens(client, server.url, prompts[i], on_token)

            moved = await asyncio.gather(*(movedstream_tokens(i) for i in range(len(prompts))))
            alone = [await stream_tokens(client, server.url, p) for p in prompts]
            return moved, alone

    moved, alone = run_async(go())
    return missed, moved, alone, moves, prompts


def test_seeded_sampling_continues_bit_identically(server):
    prompt = prompts_for([9], seed=3)[0]
    sampling = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=200)

    async def go(moves: list):
        async with httpx.AsyncClient() as client:

            async def on_token(request_id, n):
                if n >= 7 and not moves:
                    src = where_if_running(server, request_id)
                    r = None if src is None else await force_migrate(client, server.url, request_id, 1 - src)
                    moves.append(None if ended_first(r) else r)  # None: it ended on the server first

            moved = await stream_tokens(client, server.url, prompt, on_token, **sampling)
            alone = await stream_tokens(client, server.url, prompt, **sampling)
            return moved, alone

    for _ in range(3):  # a busy machine's client may read behind the server: a round whose request ended runs again
        moves: list = []
        moved, alone = run_async(go(moves))
        if moves and moves[0] is not None:
            break
    else:
        pytest.fail("three rounds in a row ended before their move")
    assert moves[0].status_code == 200 and moves[0].json()["outcome"] == "ok", moves[0].text
    assert moved["token_ids"] == alone["token_ids"] and len(moved["token_ids"]) == 200
    assert_all_blocks_free(server)


def test_migration_between_prefill_chunks(server):
    """A long prompt prefilled in chunks of 64 tokens moves before its first token: the destination
    goes on with the chunks from where the source stopped."""
    prompt = prompts_for([900], seed=17)[0]

    async def go():
        async with httpx.AsyncClient() as client:
            task = asyncio.create_task(stream_tokens(client, server.url, prompt, max_tokens=50))
            while True:  # the request is known to the API as soon as it is dispatched
                placed = [(i["index"], r) for i in instances(server) for r in i["requests"]]
                if placed:
                    break
                await asyncio.sleep(0.005)
            ((src, request_id),) = placed
            r = await force_migrate(client, server.url, request_id, 1 - src)
            moved = await task
            alone = await stream_tokens(client, server.url, prompt, max_tokens=50)
            return r, moved, alone

    r, moved, alone = run_async(go())
    assert r.status_code == 200 and r.json()["outcome"] == "ok", r.text
    assert moved["token_ids"] == alone["token_ids"] and len(moved["token_ids"]) == 50
    assert_all_blocks_free(server)


def test_no_room_on_the_destination_keeps_the_request_on_the_source(server):
    """A request holding about half of instance 1's blocks leaves no room for a longer one from instance 0."""
    # the big one holds 60 of instance 1's 120 blocks at first, more as it decodes; moving the other
    # needs 58 + 2 on top
    big, other = prompts_for([950, 920], seed=5)

    async def go():
        async with httpx.AsyncClient() as client:
            placed = asyncio.Event()
            ids = {}

            async def hold(request_id, n):
                if n == 1 and "big" not in ids:
                    ids["big"] = request_id
                    if where(server, request_id) != 1:
                        r = await force_migrate(client, server.url, request_id, 1)
                        assert r.status_code == 200, r.text
                    placed.set()

            async def try_move(request_id, n):
                if n == 1 and "other" not in ids:
                    ids["other"] = request_id
                    await placed.wait()
                    if where(server, request_id) != 0:
                        await force_migrate(client, server.url, request_id, 0)  # (has room: instance 0 is empty)
                    r = await force_migrate(client, server.url, request_id, 1)
                    ids["refused"] = r

            first = asyncio.create_task(stream_tokens(client, server.url, big, hold, max_tokens=900))
            await placed.wait()
            second = await stream_tokens(
                client, server.url, other, try_move, max_tokens=600
            )  # long: still there when moved
            alone = await stream_tokens(client, server.url, other, max_tokens=600)
            await first
            return ids["refused"], second, alone

    refused, second, alone = run_async(go())
    assert refused.status_code == 409, refused.text
    assert refused.json()["migration"]["outcome"] == "no_room", refused.text
    assert second["token_ids"] == alone["token_ids"], "the refused request went on on its source unchanged"
    assert_all_blocks_free(server)


def test_a_destination_that_stops_answering_is_given_up_on(server):
    """The tp1 instance's driver is stopped (SIGSTOP): the migration times out, the request
    completes on the source, and once the destination runs again it frees what it had reserved."""
    prompt = prompts_for([20], seed=8)[0]
    driver_pid = instances(server)[1]["pids"][0]

    async def go():
        async with httpx.AsyncClient() as client:
            out = {}

            async def on_token(request_id, n):
                if n == 3 and "r" not in out:
                    if where(server, request_id) != 0:
                        r = await force_migrate(client, server.url, request_id, 0)
                        assert r.status_code == 200, r.text
                    os.kill(driver_pid, signal.SIGSTOP)
                    try:
                        out["r"] = await force_migrate(client, server.url, request_id, 1)
                    finally:
                        os.kill(driver_pid, signal.SIGCONT)

            moved = await stream_tokens(client, server.url, prompt, on_token, max_tokens=300)
            alone = await stream_tokens(client, server.url, prompt, max_tokens=300)
            return out["r"], moved, alone

    r, moved, alone = run_async(go())
    assert r.status_code == 409 and r.json()["migration"]["outcome"] == "dest_failed", r.text
    assert moved["token_ids"] == alone["token_ids"]
    assert_all_blocks_free(server)


def test_a_client_leaving_mid_migration_leaks_nothing(server):
    prompts = prompts_for([30, 12, 25], seed=21)

    async def go():
        async with httpx.AsyncClient() as client:
            outcomes = []

            async def leave_during_move(prompt, delay):
                body = {"prompt": prompt, "stream": True, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
                async with client.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            request_id = json.loads(line[6:])["id"]
                            move = asyncio.create_task(
                                force_migrate(client, server.url, request_id, 1 - where(server, request_id))
                            )
                            await asyncio.sleep(delay)
                            break  # leaves the stream: the server aborts the request wherever it is
                outcomes.append(await move)

            await asyncio.gather(*(leave_during_move(p, d) for p, d in zip(prompts, (0.0, 0.01, 0.05))))
            return outcomes

    outcomes = run_async(go())
    for r in outcomes:
        assert r.status_code in (200, 404, 409), r.text  # moved, or ended before it could start, or on the way
        if r.status_code == 409:
            assert r.json()["migration"]["outcome"] in ("source_ended", "not_found"), r.text
    assert_all_blocks_free(server)


def test_drain_moves_every_request_off_an_instance(server):
    prompts = prompts_for([8, 16, 24, 11], seed=4)

    async def go():
        async with httpx.AsyncClient() as client:
            drained = {}

            async def on_token(request_id, n):
                if n == 2 and not drained:
                    drained["r"] = await client.post(server.url + "/admin/instances/0/drain", timeout=30)

            streams = [
                asyncio.create_task(stream_tokens(client, server.url, p, on_token if i == 0 else None))
                for i, p in enumerate(prompts)
            ]
            results = await asyncio.gather(*streams)
            insts = instances(server)
            late = await stream_tokens(client, server.url, prompts[0], max_tokens=20)
            return drained["r"], results, insts, late

    drained, results, insts, late = run_async(go())
    assert drained.status_code == 202 and drained.json()["draining"] is True, drained.text
    assert not insts[0]["running"] and not insts[0]["waiting"], insts
    assert all(len(r["token_ids"]) == LONG for r in results)
    assert "migrated" in server.log() and "(drain)" in server.log()
    assert len(late["token_ids"]) == 20
    assert_all_blocks_free(server)


def test_admin_errors_name_the_problem(server):
    r = httpx.post(server.url + "/admin/migrate", json={"request_id": "nope", "to_instance": 1}, timeout=30)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/admin/migrate", json={"request_id": "x", "to_instance": 7}, timeout=30)
    assert r.status_code == 400 and "to_instance 7" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/admin/migrate", json={"to_instance": 1}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(server.url + "/admin/instances/5/drain", timeout=30)
    assert r.status_code == 404
    insts = instances(server)
    assert [i["layout"] for i in insts] == ["tp=2", "tp=1"] and len(insts[0]["pids"]) == 2


def test_sigterm_stops_every_instance(server):
    assert server.stop() == 0, server.log()[-4000:]


def test_migration_between_pipeline_and_tensor_parallelinstances(checkpoint, tmp_path):
    """pp2 (layers 0-1 on one rank, 2-3 on the next) <-> tp1: each stage's rank sends or receives
    just its layers; with pp the pause waits for the request's sampled token to come back."""
    prompts = prompts_for([17, 33, 9], seed=31)
    with ServerJob(
        tmp_path,
        [
            "--model",
            checkpoint,
            "--instances",
            "pp2,tp1",
            "--block-size",
            "16",
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

        async def go():
            async with httpx.AsyncClient() as client:
                moves = []

                async def movedstream_tokens(prompt, after):
                    async def on_token(request_id, n):
                        if n >= after and not any(m[0] == request_id for m in moves):
                            src = where(job, request_id)
                            moves.append((request_id, src, await force_migrate(client, job.url, request_id, 1 - src)))

                    return await stream_tokens(client, job.url, prompt, on_token)

                moved = await asyncio.gather(*(movedstream_tokens(p, 2 + 3 * i) for i, p in enumerate(prompts)))
                alone = [await stream_tokens(client, job.url, p) for p in prompts]
                return moved, alone, moves

        moved, alone, moves = run_async(go())
        for m, a in zip(moved, alone):
            assert m["token_ids"] == a["token_ids"] and len(m["token_ids"]) == LONG
        assert all(r.status_code == 200 and r.json()["outcome"] == "ok" for _, _, r in moves), [
            r.text for *_, r in moves
        ]
        assert len(moves) == len(prompts) and {src for _, src, _ in moves} == {0, 1}, "rr: both directions"
        assert_all_blocks_free(job)
        assert job.stop() == 0, job.log()[-4000:]


def test_migration_over_mpi(checkpoint, tmp_path):
    """The KV blocks travel over MPI (mpi4py) when the job runs on it: under mpirun, --backend mpi."""
    import shutil

    from tests.support.processes import venv_env

    mpirun = shutil.which("mpirun", path=venv_env()["PATH"])
    if mpirun is None:
        pytest.skip("no mpirun")
    from tests.support.serving_helpers import DIST

    prompt = prompts_for([14], seed=51)[0]
    with ServerJob(
        tmp_path,
        [
            "--model",
            checkpoint,
            "--instances",
            "tp1,tp1",
            "--backend",
            "mpi",
            "--kv-blocks",
            "120",
            "--migrate-interval",
            "0",
            "--timeout",
            "60",
        ],
        prefix=[mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2"] + DIST,
    ) as job:

        async def go():
            async with httpx.AsyncClient() as client:
                out = {}

                async def on_token(request_id, n):
                    if n >= 3 and "r" not in out:
                        out["r"] = await force_migrate(client, job.url, request_id, 1 - where(job, request_id))

                moved = await stream_tokens(client, job.url, prompt, on_token)
                alone = await stream_tokens(client, job.url, prompt)
                return out["r"], moved, alone

        r, moved, alone = run_async(go())
        assert r.status_code == 200 and r.json()["outcome"] == "ok", r.text
        assert moved["token_ids"] == alone["token_ids"]
        assert_all_blocks_free(job)
        assert job.stop(api_only=True) == 0, job.log()[-4000:]

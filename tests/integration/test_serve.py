"""`dist-infer serve` as real jobs (our launcher, torchrun, mpirun) over real HTTP on 127.0.0.1.

Every request's greedy tokens equal HF transformers generating that prompt alone, under random
arrival times, chunk sizes that do not divide the prompts, and a KV cache too small for all
(forced preemption); on tp=2, pp=2 and a MoE model with ep=2. Then the OpenAI client, streaming,
seeded sampling, cancel mid-stream, bad input, SIGTERM and a dead rank.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf, prompts_for
from tests.support.processes import venv_env
from tests.support.serving_helpers import DIST, ServerJob, complete_ids, run_async, stream_ids

NEW = 6
SIGTERM_TOKENS = 200  # long enough that a client reading behind the server still has some to come
BURST_ROUNDS = 4  # more bursts of 4 long prompts sent while none has preempted


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return {"llama": write_hf_checkpoint(root, "llama-gqa"), "mixtral": write_hf_checkpoint(root, "mixtral")}


def _check_against_hf(path, prompts, got: list[list[int]], what: str) -> None:
    for i, ids in enumerate(got):
        assert len(ids) == NEW, f"{what} prompt {i}: {len(ids)} tokens"
    assert_ids_match_hf(path, prompts, got, NEW, what)


async def _random_stream(url: str, prompts, seed: int, burst: int = 0) -> list[dict]:
    """The first `burst` prompts at once (so several compete for the blocks), the others at random
    times; half streamed; greedy, exactly NEW tokens each."""
    rng = random.Random(seed)
    async with httpx.AsyncClient() as client:
        calls = []
        for i, p in enumerate(prompts):
            kind = stream_ids if i % 2 else complete_ids
            delay = 0.0 if i < burst else rng.uniform(0, 0.8)
            calls.append(kind(client, url, p, delay=delay, max_tokens=NEW, temperature=0, ignore_eos=True))
        return await asyncio.gather(*calls)


def _ids(result: dict) -> list[int]:
    return result["token_ids"] if "token_ids" in result else result["choices"][0]["token_ids"]


LAYOUTS = {
    "tp2": ("llama", ["--tp", "2"]),
    "pp2": ("llama", ["--pp", "2"]),
    "moe-ep2": ("mixtral", ["--ep", "2"]),
    "cp2": ("llama", ["--cp", "2", "--kv-blocks", "5"]),  # whole prompts per step; each rank holds half the rows
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_request_stream_matches_hf_alone(models, tmp_path, layout):
    arch, flags = LAYOUTS[layout]
    path = models[arch]
    rng = random.Random(layout)
    prompts = prompts_for(
        [rng.randint(14, 17) for _ in range(4)] + [rng.randint(3, 17) for _ in range(4)], seed=len(layout)
    )
    args = [
        "--model",
        path,
        "--nproc",
        "2",
        "--block-size",
        "4",
        "--max-batched-tokens",
        "7",
        "--kv-blocks",
        "9",
        "--max-num-seqs",
        "4",
        "--timeout",
        "60",
        *flags,
    ]
    with ServerJob(tmp_path, args) as server:
        results = run_async(_random_stream(server.url, prompts, seed=7, burst=4))
        for extra in range(BURST_ROUNDS):  # a busy machine may spread a burst out: another, until one overlaps
            if server.metrics()["dist_infer:num_preemptions_total"] > 0:
                break
            more = prompts_for([rng.randint(14, 17) for _ in range(4)], seed=100 + extra)
            results += run_async(_random_stream(server.url, more, seed=extra, burst=4))
            prompts = prompts + more
        metrics = server.metrics()
        assert metrics["dist_infer:num_preemptions_total"] > 0, (
            f"the cache holds about one 14-17 token prompt + 6 new tokens; {BURST_ROUNDS + 1} bursts of 4 must preempt"
        )
        assert metrics["dist_infer:kv_cache_usage_perc"] == 0.0, "every block free again"
        assert metrics["dist_infer:generation_tokens_total"] == NEW * len(prompts)
        assert server.stop() == 0, server.log()[-4000:]
    for r in results:
        assert (r.get("finish_reason") or r.get("choices", [{}])[0].get("finish_reason")) == "length"
    _check_against_hf(path, prompts, [_ids(r) for r in results], layout)


def _launcher_prefix(kind: str):
    if kind == "torchrun":
        return [
            shutil.which("torchrun") or str(DIST[0]).replace("dist-infer", "torchrun"),
            "--nproc-per-node",
            "2",
            "--no-python",
        ] + DIST
    mpirun = shutil.which("mpirun", path=venv_env()["PATH"])
    if mpirun is None:
        pytest.skip("no mpirun")
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2"] + DIST


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_serve_under_other_launchers(models, tmp_path, launcher):
    path = models["llama"]
    prompts = prompts_for([5, 12, 9], seed=11)
    args = ["--model", path, "--tp", "2", "--block-size", "4", "--max-batched-tokens", "8", "--timeout", "60"]
    if launcher == "mpirun":
        args += ["--backend", "mpi"]
    with ServerJob(tmp_path, args, prefix=_launcher_prefix(launcher)) as server:
        results = run_async(_random_stream(server.url, prompts, seed=3))
        code = server.stop(api_only=True)  # torchrun and mpirun treat a signal to themselves as a failure
        assert code == 0, server.log()[-4000:]
    _check_against_hf(path, prompts, [_ids(r) for r in results], launcher)


# -- one server on the default model (SmolLM2-135M-Instruct from its GGUF, tp=2 splitting 9 / 3 heads unevenly): the API surface ------------------


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    server = ServerJob(
        tmp_path_factory.mktemp("default-serve"),
        [
            "--model",
            "default",
            "--tp",
            "2",
            "--nproc",
            "2",
            "--max-batched-tokens",
            "64",
            "--kv-blocks",
            "64",
            "--max-queue",
            "64",
            "--timeout",
            "60",
        ],
    )
    yield server
    if server.proc.poll() is None:
        server.kill()


def test_openai_client_completions_and_chat(default_server):
    import openai

    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == ["default"]
    c = client.completions.create(model="default", prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens == len(c.choices[0].token_ids)
    again = client.completions.create(model="default", prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert again.choices[0].text == c.choices[0].text, "greedy is deterministic"
    streamed = client.completions.create(
        model="default",
        prompt="The quick brown fox",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in streamed:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    assert text == c.choices[0].text and usage.completion_tokens == c.usage.completion_tokens
    chat = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say hello"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    # the default model is a trained one (SmolLM2-135M-Instruct) and its chat template comes from the GGUF
    paris = client.chat.completions.create(
        model="default",
        max_tokens=24,
        temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in paris.choices[0].message.content, paris.choices[0].message.content
    pieces = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say hello"}], max_tokens=4, temperature=0, stream=True
    )
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == chat.choices[0].message.content


def test_seeded_sampling_same_alone_and_concurrent(default_server):
    prompts = [[1, 50 + i, 60 + i, 70 + i] for i in range(4)]
    body = dict(max_tokens=8, temperature=0.9, top_p=0.9, top_k=40, ignore_eos=True)

    async def go(concurrent: bool):
        async with httpx.AsyncClient() as client:
            calls = [complete_ids(client, default_server.url, p, seed=1000 + i, **body) for i, p in enumerate(prompts)]
            if concurrent:
                return [_ids(r) for r in await asyncio.gather(*calls)]
            return [_ids(await c) for c in calls]

    alone = run_async(go(False))
    assert run_async(go(True)) == alone
    assert len({tuple(a) for a in alone}) > 1


def test_logprobs_and_stop_token(default_server):
    r = httpx.post(
        default_server.url + "/v1/completions",
        json={"prompt": [1, 20, 30], "max_tokens": 4, "temperature": 0, "logprobs": 3, "ignore_eos": True},
        timeout=60,
    ).json()
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == 4 and all(len(t) == 3 for t in lp["top_logprobs"])
    ids = choice["token_ids"]
    k = next((i for i in range(1, 4) if ids[i] not in ids[:i]), None)  # a later token not seen before it
    assert k is not None, f"greedy ids {ids} repeat one token: no stop id to test with"
    r2 = httpx.post(
        default_server.url + "/v1/completions",
        json={"prompt": [1, 20, 30], "max_tokens": 4, "temperature": 0, "stop_token_ids": [ids[k]], "ignore_eos": True},
        timeout=60,
    ).json()["choices"][0]
    assert r2["token_ids"] == ids[: k + 1] and r2["finish_reason"] == "stop"


def test_stop_string_found_in_the_front_end_ends_the_request_and_frees_its_blocks(default_server):
    """The engine sends ids only; the front end finds the stop string, cuts the text and the ids
    there, and aborts the request on its instance (blocks freed), streamed or not."""
    body = {"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(default_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    text, ids = whole["text"], whole["token_ids"]
    at = len(text) // 2
    stop = text[at : at + 3]
    assert stop.strip() and text.find(stop) > 0, f"no stop string to test with in {text!r}"
    want_text = text[: text.find(stop)]
    cut = httpx.post(default_server.url + "/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    choice = cut["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (want_text, "stop", stop)
    assert ids[: len(choice["token_ids"])] == choice["token_ids"] and len(choice["token_ids"]) < len(ids)
    assert cut["usage"]["completion_tokens"] == len(choice["token_ids"])

    async def streamed():
        async with httpx.AsyncClient() as client:
            return await stream_ids(
                client, default_server.url, body["prompt"], max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]
            )

    got = run_async(streamed())
    assert (got["token_ids"], got["text"], got["finish_reason"]) == (choice["token_ids"], want_text, "stop"), got
    default_server.wait_for_metric("dist_infer:num_requests_running", lambda v: v == 0.0)
    default_server.wait_for_metric("dist_infer:kv_cache_usage_perc", lambda v: v == 0.0)


def test_cancel_mid_stream_frees_the_blocks(default_server):
    async def go():
        async with httpx.AsyncClient() as client:
            body = {"prompt": [1, 5, 6, 7], "max_tokens": 400, "stream": True, "ignore_eos": True, "temperature": 0}
            async with client.stream("POST", default_server.url + "/v1/completions", json=body, timeout=60) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen >= 3:
                        break  # leave: the connection closes with the request still running
            return seen

    assert run_async(go()) == 3
    default_server.wait_for_metric("dist_infer:kv_cache_usage_perc", lambda v: v == 0.0)
    default_server.wait_for_metric("dist_infer:num_requests_running", lambda v: v == 0.0)


BAD = [
    ("not json", None, None),
    ({"prompt": "hi", "model": "nope"}, "model", "nope"),
    ({"prompt": [1, 10**7]}, "prompt", "vocabulary"),
    ({"prompt": [1, 2], "max_tokens": 9000}, "max_tokens", "8192"),  # SmolLM2 has 8192 positions
    ({"prompt": [1, 2], "max_tokens": -1}, "max_tokens", None),
    ({"prompt": [1, 2], "temperature": -2}, "temperature", None),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [1, 2], "top_p": 7}, "top_p", None),
]


def test_bad_input_gets_400_while_others_complete(default_server):
    async def go():
        async with httpx.AsyncClient() as client:
            good = [
                complete_ids(client, default_server.url, [1, 9, 9], max_tokens=6, temperature=0, ignore_eos=True)
                for _ in range(3)
            ]
            bad = []
            for body, _, _ in BAD:
                kw = {"content": body} if isinstance(body, str) else {"json": body}
                bad.append(
                    client.post(
                        default_server.url + "/v1/completions",
                        timeout=60,
                        headers={"content-type": "application/json"},
                        **kw,
                    )
                )
            return await asyncio.gather(*good), await asyncio.gather(*bad)

    good, bad = run_async(go())
    assert all(len(_ids(g)) == 6 for g in good)
    for (body, param, needle), resp in zip(BAD, bad):
        assert resp.status_code == 400, (body, resp.status_code, resp.text)
        err = resp.json()["error"]
        assert err["message"] and err["type"], err
        if param:
            assert err["param"] == param, (body, err)
        if needle:
            assert needle in err["message"], (body, err)


def test_health_and_metrics_names(default_server):
    assert httpx.get(default_server.url + "/health", timeout=30).status_code == 200
    text = httpx.get(default_server.url + "/metrics", timeout=30).text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "prompt_tokens_total",
        "generation_tokens_total",
    ):
        assert f"dist_infer:{name}" in text, name
    # the step-time histogram by kind, per instance: a request's prompt and its decodes were timed
    httpx.post(
        default_server.url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 3}, timeout=60
    ).raise_for_status()
    text = httpx.get(default_server.url + "/metrics", timeout=30).text
    counts = {
        line.split('kind="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dist_infer:step_duration_seconds_count{")
    }
    assert counts.get("prefill", 0) > 0 and counts.get("decode", 0) > 0, counts


def test_sigterm_finishes_running_requests_and_exits_0(default_server):
    """SIGTERM once the stream's first chunk has arrived (so the request is running, not yet done):
    the server drains it (all 60 tokens, finish_reason length) and then exits 0."""

    async def go():
        first_chunk = asyncio.Event()
        ids: list[int] = []

        def on_chunk(ids_so_far: list[int]) -> None:
            ids[:] = ids_so_far
            first_chunk.set()

        async with httpx.AsyncClient() as client:
            task = asyncio.create_task(
                stream_ids(
                    client,
                    default_server.url,
                    [1, 4, 4],
                    max_tokens=SIGTERM_TOKENS,
                    temperature=0,
                    ignore_eos=True,
                    on_chunk=on_chunk,
                )
            )
            waiter = asyncio.create_task(first_chunk.wait())
            await asyncio.wait([task, waiter], timeout=120, return_when=asyncio.FIRST_COMPLETED)
            assert first_chunk.is_set(), f"no chunk within 120 s (stream done: {task.done()})"
            received_at_signal = len(ids)
            default_server.proc.send_signal(signal.SIGTERM)
            return received_at_signal, await task

    received_at_signal, result = run_async(go())
    assert received_at_signal < SIGTERM_TOKENS, "the stream ended before SIGTERM: the drain was not exercised"
    assert len(result["token_ids"]) == SIGTERM_TOKENS and result["finish_reason"] == "length"
    default_server.proc.wait(90)
    assert default_server.proc.returncode == 0, default_server.log()[-4000:]


def test_a_dead_rank_ends_the_server_naming_it(models, tmp_path):
    """A single instance whose follower rank dies: its job's launcher names the rank, and the API
    process (which runs no rank) exits non-zero because no instance is left."""
    from tests.support.serving_helpers import instances

    args = ["--model", models["llama"], "--tp", "2", "--nproc", "2", "--timeout", "20"]
    with ServerJob(tmp_path, args) as server:
        pids = instances(server)[0]["pids"]
        assert len(pids) == 2 and server.api_pid not in pids, pids
        subprocess.run(["kill", "-9", str(pids[1])])
        start = time.monotonic()
        server.proc.wait(60)
        log = server.log()
    assert server.proc.returncode != 0
    assert time.monotonic() - start < 60
    assert "rank 1" in log and "SIGKILL" in log and "no instance is left" in log, log[-3000:]

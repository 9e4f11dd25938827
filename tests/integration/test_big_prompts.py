"""Large bodies and long prompts in the API's worker processes (serving/http/worker_pool.py): the same
answers as in-process, a worker that dies, and /health answering while prompts are tokenized by
an encode that holds the GIL (as `tokenizers`' does), which a thread could not hide."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from dist_infer.models.tiny_model import build_tokenizer
from dist_infer.serving.http import worker_pool
from dist_infer.serving.http.api_server import DrainingServer, build_app
from dist_infer.serving.http.guard import ApiError
from dist_infer.serving.http.json_body import ProtocolError, json_of
from dist_infer.serving.http.worker_pool import WorkerPool
from tests.support.fake_engine import MODEL, FakeEngine
from tests.support.gil_tokenizer import GilHoldingTokenizer

HOLD_S = 1.5  # each encode holds the GIL this long


def test_workers_parse_and_encode_as_this_process_does():
    backend = build_tokenizer()
    text = "def f(x):\n    return x * 2  # é 日本\n" * 400
    pool = WorkerPool(backend)

    async def go():
        ids = await pool.encode(text)
        count = await pool.encode(text, limit=10)
        body = json.dumps({"prompt": text, "ids": list(range(5000))}).encode()
        parsed = await pool.parse_json(body)
        with pytest.raises(ProtocolError) as bad:
            await pool.parse_json(b'{"prompt": "\\ud800"}')
        return ids, count, parsed, body, bad.value

    try:
        ids, count, parsed, body, bad = asyncio.run(go())
    finally:
        pool.close()
    assert ids == backend.encode(text, add_special_tokens=False).ids and count == len(ids) > 10
    assert parsed == json_of(body)
    assert bad.field == "prompt" and "surrogate" in str(bad)


def test_a_worker_that_dies_fails_its_request_with_503_and_the_next_gets_new_workers():
    pool = WorkerPool(build_tokenizer(), processes=1)

    async def go():
        await pool.encode("warm up")
        (process,) = pool._executor._processes.values()
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(ApiError) as died:
            await pool.encode("x" * 100_000)
        return died.value, await pool.encode("hello")

    try:
        died, ids = asyncio.run(go())
    finally:
        pool.close()
    assert died.status == 503 and "Retry-After" in died.headers
    assert ids == build_tokenizer().encode("hello", add_special_tokens=False).ids


def serve(engine: FakeEngine):
    ready, port = threading.Event(), {}
    server = DrainingServer(
        build_app(engine, MODEL), "127.0.0.1", 0, grace_s=1.0, on_ready=lambda host, p: (port.update(p=p), ready.set())
    )
    thread = threading.Thread(target=server.run, name="uvicorn-big-prompts", daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    return f"http://127.0.0.1:{port['p']}", server, thread


def health_while_tokenizing(prompts: int, chars: int) -> tuple[list[float], list[httpx.Response], float]:
    """Post `prompts` prompts of `chars` characters at once; probe /health every 20 ms until all are
    answered. (/health latencies, the answers, seconds the prompts took)."""
    engine = FakeEngine()
    engine.max_model_len = 10 * chars
    engine.tokenizer = GilHoldingTokenizer(HOLD_S)
    url, server, thread = serve(engine)
    answers: list = [None] * prompts

    def post(i: int) -> None:
        with httpx.Client(trust_env=False, timeout=120) as h:
            answers[i] = h.post(url + "/v1/completions", json={"prompt": "a" * chars, "max_tokens": 1})

    posters = [threading.Thread(target=post, args=(i,)) for i in range(prompts)]
    start = time.monotonic()
    latencies = []
    try:
        for t in posters:
            t.start()
        with httpx.Client(trust_env=False, timeout=60) as h:
            while any(t.is_alive() for t in posters):
                sent = time.monotonic()
                assert h.get(url + "/health").status_code == 200
                latencies.append(time.monotonic() - sent)
                time.sleep(0.02)
        took = time.monotonic() - start
    finally:
        for t in posters:
            t.join(120)
        server.request_shutdown()
        thread.join(30)
    return latencies, answers, took


def test_health_answers_while_gil_holding_encodes_run_in_workers():
    latencies, answers, took = health_while_tokenizing(3, worker_pool.POOL_MIN_CHARS)
    assert all(
        r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == worker_pool.POOL_MIN_CHARS + 1 for r in answers
    ), [r.text for r in answers]
    assert took >= 2 * HOLD_S  # 3 encodes of HOLD_S on 2 workers
    assert len(latencies) >= 10 and max(latencies) < HOLD_S / 2, sorted(latencies)[-5:]


def test_the_same_encodes_in_a_thread_stop_health(monkeypatch):
    """The control: what the test above would see without workers (the prompts stay under the
    pool's threshold), so its bound does tell the two apart."""
    monkeypatch.setattr(worker_pool, "POOL_MIN_CHARS", 10**9)
    monkeypatch.setattr("dist_infer.serving.http.state.POOL_MIN_CHARS", 10**9)
    latencies, answers, _ = health_while_tokenizing(3, 8192)
    assert all(r.status_code == 200 for r in answers)
    assert max(latencies) >= HOLD_S / 2, sorted(latencies)[-5:]

"""Large bodies and long prompts in the API's worker processes (serving/http/worker_pool.py): the same
answers as in-process, a worker that dies, and /health answering while prompts are tokenized by
an encode that holds the GIL (as `tokenizers`' does), which a thread could not hide."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

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
from tests.support.paths import JOBS


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


def health_while_tokenizing(gate: Path, prompts: int, chars: int, started: int, probe_timeout: float):
    """Post `prompts` prompts of `chars` characters at once, each encode held until a prober in
    another process has seen `started` of them begin and asked /health once (with
    `probe_timeout`): (what the probe got, the answers)."""
    engine = FakeEngine()
    engine.max_model_len = 10 * chars
    engine.tokenizer = GilHoldingTokenizer(gate)
    url, server, thread = serve(engine)
    probe = subprocess.Popen(
        [sys.executable, str(JOBS / "health_probe.py"), url, str(gate), str(started), str(probe_timeout)]
    )
    answers: list = [None] * prompts

    def post(i: int) -> None:
        with httpx.Client(trust_env=False, timeout=300) as h:
            answers[i] = h.post(url + "/v1/completions", json={"prompt": "a" * chars, "max_tokens": 1})

    posters = [threading.Thread(target=post, args=(i,)) for i in range(prompts)]
    try:
        for t in posters:
            t.start()
        for t in posters:
            t.join(300)
        assert probe.wait(300) == 0
    finally:
        (gate / "released").touch()  # whatever happened, no encode waits on
        if probe.poll() is None:
            probe.kill()
        server.request_shutdown()
        thread.join(30)
    return (gate / "probe").read_text(), answers


def test_health_answers_while_gil_holding_encodes_run_in_workers(tmp_path):
    # two workers: two encodes hold theirs while /health is asked, the third waits its turn
    outcome, answers = health_while_tokenizing(tmp_path, 3, worker_pool.POOL_MIN_CHARS, started=2, probe_timeout=60)
    assert outcome == "answered 200"
    assert all(
        r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == worker_pool.POOL_MIN_CHARS + 1 for r in answers
    ), [r.text for r in answers]


def test_the_same_encodes_in_a_thread_stop_health(monkeypatch, tmp_path):
    """The control: without workers (the prompts stay under the pool's threshold) an encode holds
    this process's GIL, and /health cannot answer until it is let go (the probe lets it go only
    after its own timeout), so the test above does tell the two apart."""
    monkeypatch.setattr(worker_pool, "POOL_MIN_CHARS", 10**9)
    monkeypatch.setattr("dist_infer.serving.http.state.POOL_MIN_CHARS", 10**9)
    outcome, answers = health_while_tokenizing(tmp_path, 3, 8192, started=1, probe_timeout=2)
    assert outcome == "timed out"
    assert all(r.status_code == 200 for r in answers)

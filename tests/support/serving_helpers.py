"""Real `dist-infer serve` jobs for the tests: start one, wait until it accepts requests, talk
HTTP to it on 127.0.0.1, stop it with SIGTERM and read its exit code and logs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import httpx

from tests.support.paths import REPO, VENV_BIN
from tests.support.polling import wait_until
from tests.support.processes import end_tree, venv_env
from tests.support.zygote import command

DIST = [str(VENV_BIN / "dist-infer")]
LOCAL_TEST_MAX_RANKS = 8  # --max-ranks of a local-placement test server that names none


class ServerJob:
    """A serve job in its own process group; logs go to a file (a pipe nobody reads would fill up)."""

    def __init__(
        self,
        tmp_path: Path,
        args: Sequence[str],
        prefix: Optional[Sequence[str]] = None,
        env: Optional[dict] = None,
        ready_timeout: float = 180.0,
    ):
        self.dir = Path(tmp_path)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ready_file = self.dir / f"ready-{time.monotonic_ns()}.json"
        self.log_path = self.dir / f"serve-{time.monotonic_ns()}.log"
        args = [*map(str, args)]
        if "--max-ranks" not in args and "--placement" not in args:
            # the tests run a few tiny instances side by side, more ranks than a 2-core machine's
            # cores (local placement's default --max-ranks); Ray and Slurm tests keep their default
            args += ["--max-ranks", str(LOCAL_TEST_MAX_RANKS)]
        cmd = list(prefix or DIST) + ["serve", *args, "--port", "0", "--ready-file", str(self.ready_file)]
        self.cmd = cmd
        self._log = open(self.log_path, "w")
        env = env or venv_env()
        self.proc = subprocess.Popen(
            command(cmd, env),  # forked from the suite's zygote when it can be
            env=env,
            cwd=str(REPO),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + ready_timeout
        while not self.ready_file.exists() or not self.ready_file.read_text().strip():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"server exited {self.proc.returncode} before it was ready: {cmd}\n{self.log()[-6000:]}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"server not ready after {ready_timeout} s: {cmd}\n{self.log()[-6000:]}")
            time.sleep(0.2)
        info = json.loads(self.ready_file.read_text())
        self.url = f"http://127.0.0.1:{info['port']}"
        self.api_pid = info["pid"]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """The unlabelled-by-value samples of /metrics as name -> value (labels dropped, summed)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
        return out

    def wait_for_metric(self, name: str, predicate, timeout: float = 30.0) -> float:
        seen = [None]

        def holds():
            seen[0] = value = self.metrics().get(name)
            return value is not None and predicate(value) and (value,)  # a tuple: 0.0 may be the awaited value

        return wait_until(holds, timeout, lambda: f"{name} (now {seen[0]})", interval=0.2)[0]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90.0, api_only: bool = False) -> int:
        """Signal the job's first process (the launcher, or the server itself), or with `api_only`
        rank 0's process alone, and wait for the job's exit code."""
        if self.proc.poll() is None:
            os.kill(self.api_pid if api_only else self.proc.pid, sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"server still running {timeout} s after {signal.Signals(sig).name}\n{self.log()[-6000:]}"
            )
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        end_tree(self.proc)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.kill()


async def complete_ids(client: httpx.AsyncClient, url: str, prompt: list[int], delay: float = 0.0, **body) -> dict:
    """POST one token-id completion after `delay` seconds; the parsed response."""
    await asyncio.sleep(delay)
    r = await client.post(url + "/v1/completions", json={"prompt": prompt, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


async def stream_ids(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    delay: float = 0.0,
    on_chunk: Optional[Callable[[list[int]], None]] = None,
    **body,
) -> dict:
    """Stream one completion; returns {'token_ids', 'text', 'finish_reason', 'usage', 'chunks'}.
    `on_chunk(token ids so far)` is called after each chunk."""
    await asyncio.sleep(delay)
    ids, text, finish, usage, chunks = [], "", None, None, 0
    body = {"prompt": prompt, "stream": True, "stream_options": {"include_usage": True}, **body}
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, await r.aread()
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            assert "error" not in event, event
            chunks += 1
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            if on_chunk is not None:
                on_chunk(list(ids))
        assert done, "the stream must end with data: [DONE]"
    return {"token_ids": ids, "text": text, "finish_reason": finish, "usage": usage, "chunks": chunks}


def instances(server) -> list[dict]:
    return httpx.get(server.url + "/admin/instances", timeout=30).json()["instances"]


def wait_state(job, index: int, state: str, timeout: float = 120.0) -> dict:
    """Instance `index` as /admin/instances describes it, once it is in `state`."""
    insts: list[dict] = []

    def in_state():
        insts[:] = instances(job)
        return index < len(insts) and insts[index]["state"] == state and insts[index]

    return wait_until(
        in_state, timeout, lambda: f"instance {index} {state}: {insts}\n{job.log()[-4000:]}", interval=0.2
    )


def where(server, request_id: str) -> int:
    for inst in instances(server):
        if request_id in inst["requests"]:
            return inst["index"]
    raise AssertionError(f"{request_id} is on no instance: {instances(server)}")


def assert_all_blocks_free(server, timeout: float = 20.0) -> None:
    insts: list[dict] = []

    def all_free():
        insts[:] = instances(server)
        return all(i["free_blocks"] == i["total_blocks"] and not i["running"] and not i["waiting"] for i in insts)

    wait_until(all_free, timeout, lambda: f"KV blocks all free again: {insts}", interval=0.1)


def assert_live_blocks_free(job, timeout: float = 30.0) -> None:
    """As assert_all_blocks_free, over the instances that are serving or stopping (not the dead)."""
    live: list[dict] = []

    def all_free():
        live[:] = [i for i in instances(job) if i["state"] in ("serving", "stopping")]
        return all(i["free_blocks"] == i["total_blocks"] and not i["running"] and not i["waiting"] for i in live)

    wait_until(all_free, timeout, lambda: f"KV blocks of the live instances all free again: {live}", interval=0.1)


async def stream_tokens(client, url, prompt, on_token=None, errors_ok: bool = False, **body) -> dict:
    """Stream one completion (greedy, 400 tokens, EOS ignored unless `body` says otherwise);
    `on_token(request_id, tokens so far)` may act mid-stream (await-able).
    With `errors_ok` an error (an error answer, an error event, a broken stream) ends it and is
    returned as "error" instead of failing the test."""
    ids, request_id, finish, error = [], None, None, None
    body = {"prompt": prompt, "stream": True, "max_tokens": 400, "temperature": 0, "ignore_eos": True, **body}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:  # failed before its first token: an error answer, not a stream
                assert errors_ok, await r.aread()
                return {"id": None, "token_ids": [], "error": json.loads(await r.aread())["error"]["message"]}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    assert errors_ok, event
                    error = event["error"]["message"]
                    break
                request_id = event["id"]
                for choice in event["choices"]:
                    ids += choice.get("token_ids") or []
                    finish = choice.get("finish_reason") or finish
                if on_token is not None:
                    await on_token(request_id, len(ids))
    except httpx.HTTPError as exc:
        if not errors_ok:
            raise
        error = f"{type(exc).__name__}: {exc}"
    return {"id": request_id, "token_ids": ids, "finish_reason": finish, "error": error}


async def force_migrate(client, url, request_id, to_instance) -> httpx.Response:
    return await client.post(
        url + "/admin/migrate", json={"request_id": request_id, "to_instance": to_instance}, timeout=120
    )


def run_async(coro):
    return asyncio.run(coro)


def ended_first(response) -> bool:
    """A move that found its request ended (None: it was on no instance already)."""
    return response is None or (response.status_code == 404 and "is not running or waiting" in response.text)


def where_if_running(job, request_id: str):
    """The instance running the request, or None once it has ended."""
    try:
        return where(job, request_id)
    except AssertionError as exc:
        assert "is on no instance" in str(exc), exc
        return None


def kill_when_on(job, instance: int, pid: int | Sequence[int], after: int, record: dict):
    """An on_token callback for every stream of a test: at the first one past `after` tokens that runs
    on `instance`, SIGKILL `pid` (or each of several), once. Whichever stream dispatch put there
    triggers it (a busy machine may reorder dispatches), and a stream that has ended already is passed
    over. `record` gets the request's id, the tokens its client had, and how many requests the
    instance ran just before the kill. (Migrations off: a request stays where it was first seen.)"""
    looked: dict[str, Optional[int]] = {}  # request id -> where it ran when first looked up

    async def on_token(request_id: str, n: int) -> None:
        if n < after or record:
            return
        if request_id not in looked:
            looked[request_id] = where_if_running(job, request_id)
        if looked[request_id] == instance:
            ran = instances(job)[instance]["requests"]
            record.update(id=request_id, at=n, on=instance, on_victim=len(ran))
            for p in [pid] if isinstance(pid, int) else pid:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:  # one rank dying may take the others down first
                    pass

    return on_token

"""SIGTERM to a real server process (serve_http in front of tests/support/fake_engine.py's fake
engine): the running stream finishes, shutdown hooks run, the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx

from tests.support.paths import REPO
from tests.support.polling import wait_until


def http() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=30)  # loopback only, whatever the environment says


def test_sigterm_drains_and_exits_0(tmp_path):
    ready_file = tmp_path / "ready.json"
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); "
        f"from tests.support.fake_engine import serve_fake_engine_main; "
        f"serve_fake_engine_main({str(ready_file)!r}, 0.02, 20.0)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: ready_file.exists() and ready_file.read_text() or proc.poll() is not None, 60, "the server ready"
        )
        assert proc.poll() is None, proc.communicate()[0]
        url = f"http://127.0.0.1:{json.loads(ready_file.read_text())['port']}/v1"
        with (
            http() as h,
            h.stream("POST", url + "/completions", json={"prompt": [1, 3], "max_tokens": 40, "stream": True}) as r,
        ):
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        assert sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in rest[:-1]) == 39
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "on_shutdown called" in out and "serve_http returned; aborted=[]" in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

"""What the client jobs run inside a test "host" (a network namespace) share: the serve job's URL
from its ready file, the instances /admin/instances lists, and one greedy completion streamed as token
ids with a hook per event."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

import httpx


def wait_for_url(ready: Path, timeout: float = 240.0) -> str:
    """The serve job's URL once its ready file is written (SystemExit after `timeout`)."""
    deadline = time.monotonic() + timeout
    while not ready.exists() or not ready.read_text().strip():
        if time.monotonic() > deadline:
            raise SystemExit("the server did not become ready")
        time.sleep(0.2)
    info = json.loads(ready.read_text())
    return f"http://{info['host']}:{info['port']}"


def instances(url: str) -> list[dict]:
    """The serve job's instances as /admin/instances describes them."""
    return httpx.get(url + "/admin/instances", timeout=30).json()["instances"]


def stream_ids(url: str, prompt: list[int], max_tokens: int, on_event: Optional[Callable] = None) -> list[int]:
    """Stream a greedy completion of `prompt` (EOS ignored); `on_event(request_id, ids so far)` after each event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    ids: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            ids += event["choices"][0].get("token_ids") or []
            if on_event is not None:
                on_event(event["id"], ids)
    return ids

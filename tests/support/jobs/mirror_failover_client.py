"""Run inside a test "host" (a network namespace): wait for a serve job's ready file (two instances,
one a host, `--kv-mirror buddy`), stream one greedy request; once it runs on instance 1 (moved there
live if dispatch put it on 0) and instance 0 holds its mirror, SIGKILL instance 1's ranks; the
stream goes on from the mirror. Then the same request alone; print {"chaos": ids, "alone": ids,
"migration": result or None, "instances": [...]} as JSON.

    python mirror_failover_client.py READY_FILE PROMPT_IDS(comma-separated) MAX_TOKENS
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
from serve_client import instances, stream_ids, wait_for_url  # beside this file (the script's folder is on sys.path)


def wait_mirrored(url: str, request_id: str, blocks: int) -> bool:
    """Until instance 0 holds `blocks` of instance 1's blocks from committed rounds (a round's leases
    count from its reserve, and a kill before its commit undoes them) (bounded); False if the request
    ended first."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        insts = instances(url)
        if request_id not in insts[1]["requests"]:
            return False
        if (insts[0]["kv_mirror"] or {}).get("committed_blocks", 0) >= blocks:
            return True
        time.sleep(0.05)
    raise SystemExit("the mirror never caught up")


def main() -> None:
    ready, prompt, max_tokens = Path(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    url = wait_for_url(ready)
    out: dict = {"migration": None}

    def kill(request_id: str, ids: list[int]) -> None:
        if "killed" in out or len(ids) < 3:
            return
        out["killed"] = False
        insts = instances(url)
        if request_id in insts[0]["requests"]:
            out["migration"] = httpx.post(
                url + "/admin/migrate", timeout=120, json={"request_id": request_id, "to_instance": 1}
            ).json()
        if wait_mirrored(url, request_id, len(prompt) // 16):
            for pid in insts[1]["pids"]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # gone with another rank of it
                    pass
            out["killed"] = True

    out["chaos"] = stream_ids(url, prompt, max_tokens, kill)
    out["alone"] = stream_ids(url, prompt, max_tokens)
    time.sleep(0.5)
    out["instances"] = instances(url)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

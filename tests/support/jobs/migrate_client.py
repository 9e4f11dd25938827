"""Run inside a test "host" (a network namespace): wait for a serve job's ready file, stream one greedy
request that is migrated to the other instance after a few tokens, then the same request unmoved;
print {"moved": ids, "alone": ids, "migration": result, "instances": [...]} as JSON.

    python migrate_client.py READY_FILE PROMPT_IDS(comma-separated) MAX_TOKENS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx


def main() -> None:
    ready, prompt, max_tokens = Path(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    deadline = time.monotonic() + 240
    while not ready.exists() or not ready.read_text().strip():
        if time.monotonic() > deadline:
            raise SystemExit("the server did not become ready")
        time.sleep(0.2)
    info = json.loads(ready.read_text())
    url = f"http://{info['host']}:{info['port']}"
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    out = {}

    def stream(move: bool) -> list[int]:
        ids = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                ids += event["choices"][0].get("token_ids") or []
                if move and "migration" not in out and len(ids) >= 3:
                    insts = httpx.get(url + "/admin/instances", timeout=30).json()["instances"]
                    src = next(i["index"] for i in insts if event["id"] in i["requests"])
                    out["migration"] = httpx.post(
                        url + "/admin/migrate", timeout=120, json={"request_id": event["id"], "to_instance": 1 - src}
                    ).json()
        return ids

    out["moved"] = stream(True)
    out["alone"] = stream(False)
    time.sleep(0.5)
    out["instances"] = httpx.get(url + "/admin/instances", timeout=30).json()["instances"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()

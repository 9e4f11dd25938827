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
from serve_client import instances, stream_ids, wait_for_url  # beside this file (the script's folder is on sys.path)


def main() -> None:
    ready, prompt, max_tokens = Path(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
    url = wait_for_url(ready)
    out = {}

    def move(request_id: str, ids: list[int]) -> None:
        if "migration" not in out and len(ids) >= 3:
            insts = instances(url)
            src = next(i["index"] for i in insts if request_id in i["requests"])
            out["migration"] = httpx.post(
                url + "/admin/migrate", timeout=120, json={"request_id": request_id, "to_instance": 1 - src}
            ).json()

    out["moved"] = stream_ids(url, prompt, max_tokens, move)
    out["alone"] = stream_ids(url, prompt, max_tokens)
    time.sleep(0.5)
    out["instances"] = instances(url)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

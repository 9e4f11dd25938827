"""Probe a server's /health from outside its process while its encodes hold the gate shut:
wait for N encodes to have started (tests/support/gil_tokenizer.py), GET /health once with a
timeout, write what happened to GATE/probe ("answered <status>" or "timed out"), then open the gate.

    python health_probe.py URL GATE N TIMEOUT_S
"""

import pathlib
import sys
import time
import urllib.error
import urllib.request

url, gate, started, timeout = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + 120
while len(list(gate.glob("started.*"))) < started and time.monotonic() < deadline:
    time.sleep(0.02)
try:
    with urllib.request.urlopen(url + "/health", timeout=timeout) as response:
        outcome = f"answered {response.status}"
except (TimeoutError, urllib.error.URLError) as exc:
    outcome = "timed out" if "timed out" in str(exc) or isinstance(exc, TimeoutError) else f"failed {exc}"
(gate / "probe").write_text(outcome)
(gate / "released").touch()

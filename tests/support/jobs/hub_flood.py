"""Flood a hub with strangers' connections while a driver with the key joins it; print what it cost.

    python tests/support/jobs/hub_flood.py --seconds 20 --clients 20 --mode wrongkey

runs a Hub (serving/fleet/hub.py) on 127.0.0.1 in this process, with its log in a file; a second
process reconnects `--clients` threads to it as fast as they can for `--seconds` (a wrong key,
connect-and-close, garbage, silence until the hub hangs up, or half wrong key and half close:
`mixed`); `--join-at` seconds in,
a driver joins with the right key (serving/instance/join.py's join_hub) and says hello. Prints one JSON
line: log lines and bytes written during the flood, connections made, whether and how fast the
driver joined. tests/integration/test_hub_flood.py runs it; docs/security.md quotes its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client

KEY = b"the-cluster-key-" * 2


def _stranger(address: tuple, mode: str, until: float, counts: list, slot: int) -> None:
    """One client reconnecting as fast as it can until `until`, failing the handshake each time."""
    while time.monotonic() < until:
        counts[slot] += 1
        try:
            if mode == "wrongkey":
                Client(address, authkey=b"not-the-key")
            else:
                with socket.create_connection(address, timeout=max(0.1, until - time.monotonic())) as sock:
                    if mode == "garbage":
                        sock.sendall(b"\x00\x00\x00\x04junk")
                    while mode == "silent" and sock.recv(4096):  # says nothing until the hub hangs up (or the end)
                        pass
        except Exception:  # noqa: BLE001 - refused, reset, wrong key: all expected; reconnect
            pass


def flood(address: tuple, clients: int, seconds: float, mode: str) -> int:
    """Run `clients` strangers for `seconds`; -> connections made."""
    until = time.monotonic() + seconds
    counts = [0] * clients
    modes = [("wrongkey" if i % 2 else "close") if mode == "mixed" else mode for i in range(clients)]
    threads = [
        threading.Thread(target=_stranger, args=(address, modes[i], until, counts, i), daemon=True)
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return sum(counts)


def measure(args) -> dict:
    from loguru import logger

    from dist_infer.serving.fleet.hub import Hub
    from dist_infer.serving.fleet.wire import Hello
    from dist_infer.serving.instance.join import join_hub

    log_path = args.log or tempfile.mktemp(suffix=".log")
    open(log_path, "w").close()  # loguru appends
    logger.remove()
    logger.add(log_path, level="INFO")
    logger.enable("dist_infer")  # the library is silent until a program sets up its logging
    hub = Hub("127.0.0.1", KEY)
    joined = threading.Event()
    hub.start(lambda conn, hello: joined.set())
    strangers = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--flood",
            f"{hub.address[0]}:{hub.address[1]}",
            "--clients",
            str(args.clients),
            "--seconds",
            str(args.seconds),
            "--mode",
            args.mode,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(args.join_at)
    began, error = time.monotonic(), None
    try:
        conn = join_hub(hub.address, KEY, 0)
        conn.send(Hello.from_fields(index=0, tp=1, pp=1, total_blocks=8, block_size=4, max_positions=64, vocab_size=10))
    except Exception as exc:  # noqa: BLE001 - the figure to report
        error = f"{type(exc).__name__}: {exc}"
    ok = error is None and joined.wait(30)
    join_s = time.monotonic() - began
    out, _ = strangers.communicate(timeout=args.seconds + 60)
    time.sleep(1.1)  # the last second's counts go out at the hub loop's next flush
    hub.close()
    logger.remove()
    with open(log_path, "rb") as f:
        data = f.read()
    if not args.log:
        os.unlink(log_path)
    return {
        "mode": args.mode,
        "clients": args.clients,
        "seconds": args.seconds,
        "connections": int(out.strip() or 0),
        "refused": hub.refused,
        "log_lines": data.count(b"\n"),
        "log_bytes": len(data),
        "joined": ok,
        "join_s": round(join_s, 2),
        "join_error": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the strangers reconnect")
    parser.add_argument("--clients", type=int, default=20, help="strangers reconnecting at once")
    parser.add_argument(
        "--mode",
        choices=("wrongkey", "close", "garbage", "silent", "mixed"),
        default="wrongkey",
        help="how each stranger fails the handshake",
    )
    parser.add_argument("--join-at", type=float, default=5.0, help="seconds into the flood the driver joins")
    parser.add_argument("--log", help="keep the hub's log in this file (default: a temporary file, removed)")
    parser.add_argument("--flood", help="HOST:PORT: be the strangers' process (internal)")
    args = parser.parse_args()
    if args.flood:
        host, _, port = args.flood.rpartition(":")
        print(flood((host, int(port)), args.clients, args.seconds, args.mode))
        return
    print(json.dumps(measure(args)))


if __name__ == "__main__":
    main()

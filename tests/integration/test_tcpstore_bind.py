"""The job's rendezvous store listens on MASTER_ADDR's address, not on every interface:
a real 2-process gloo job is held open while its listening sockets are inspected. (The address
resolution and the loopback-master refusal, in process: tests/unit/comm/test_rendezvous_address.py.)"""

from __future__ import annotations

import socket
import sys
import textwrap
import time

import pytest

from dist_infer.topology import free_port
from tests.support.processes import finish, start

psutil = pytest.importorskip("psutil")
JOB_TIMEOUT = 120
WILDCARDS = {"0.0.0.0", "::", ""}

HOLD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from dist_infer.comm.init import init_world

    world = init_world("gloo", timeout=60)
    world.barrier()
    out = Path(sys.argv[1])
    (out / f"ready-{os.environ['RANK']}").write_text(f"{os.getpid()} {os.environ['MASTER_ADDR']}")
    deadline = time.monotonic() + 60
    while not (out / "done").exists() and time.monotonic() < deadline:  # held while the test looks
        time.sleep(0.05)
    world.barrier()
""")


def _non_loopback_ip() -> str | None:
    """An IPv4 address of this host other than loopback (what a multi-host job's MASTER_ADDR is)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        ip = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if ip.startswith("127.") else ip


def _listening(pids: list[int]) -> list[tuple[int, str, int]]:
    found = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        found += [(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


@pytest.mark.parametrize("where", ["loopback", "host_ip"])
def test_no_rank_listens_on_every_interface(where, tmp_path):
    addr = "127.0.0.1" if where == "loopback" else _non_loopback_ip()
    if addr is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    port = free_port()
    proc = start(
        [
            "dist-infer",
            "launch",
            "--nproc-per-node",
            "2",
            "--master-addr",
            addr,
            "--master-port",
            str(port),
            "--",
            sys.executable,
            str(script),
            str(tmp_path),
        ]
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        ready = [tmp_path / f"ready-{r}" for r in range(2)]
        while not all(p.exists() for p in ready) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert all(p.exists() for p in ready), "the job did not start"
        pids = [int(p.read_text().split()[0]) for p in ready]
        assert all(p.read_text().split()[1] == addr for p in ready)
        sockets = _listening(pids + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)])
        assert (pids[0], addr, port) in sockets, f"rank 0 does not serve the store on {addr}:{port}: {sockets}"
        assert not [s for s in sockets if s[1] in WILDCARDS], f"listening on every interface: {sockets}"
    finally:
        (tmp_path / "done").write_text("")
        result = finish(proc, JOB_TIMEOUT)
    assert result.returncode == 0

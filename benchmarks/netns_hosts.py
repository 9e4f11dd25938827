"""Two "hosts" on one machine for the benchmarks: two network namespaces joined by a veth pair,
each with its own address (10.231.X.1 and 10.231.X.2 on one /24), interfaces and TCP stack, as
tests/integration/test_two_hosts.py builds them. A job runs as one `dist-infer launch --hostfile HF
--node-rank K` per namespace (`ip netns exec NS ...`), its ranks talking gloo over TCP across the
veth; only the namespaces' 10.231.* addresses and loopback are ever contacted.

The plain veth pair has no wire and no rate limit: the kernel hands each packet to the peer
namespace's stack, so its speed is the CPU's, about loopback's, with an MTU of 1500 (loopback's
is 65536). `link_rate` (tc's units: 10gbit, 1gbit, 500mbit) puts a token-bucket filter (tbf) on
both ends, for a slower interconnect's bandwidth; it adds no latency (netem, which would, is not
in every kernel). Needs root (CAP_NET_ADMIN).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from dist_infer.topology.cores import threads_per_rank

BIN = Path(sys.executable).parent

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def rate_bits_per_s(rate: str) -> int:
    """tc's rate text ('10gbit', '500mbit', '1.5gbit') in bits per second; ValueError if not one."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*", rate.lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"link rate {rate!r}: expected a number and bit, kbit, mbit, gbit or tbit (e.g. 10gbit)")
    return int(float(m.group(1)) * _RATE_UNITS[m.group(2)])


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")


@dataclass
class TwoHosts:
    names: list[str]  # the namespaces, node 0 first
    addrs: list[str]  # their veth addresses
    veths: list[str]
    hostfile: Path  # one rank per namespace
    link_rate: Optional[str] = None
    _port: int = 29600

    def run(self, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        """`command` as a two-rank job, one rank per namespace: node 0's stdout (where rank 0 prints)
        and both nodes' stderr. A node that fails, or the timeout, stops the other.

        The two "hosts" share this machine's cores, so each rank gets half of them, as the two
        ranks of a one-host job do (unless OMP_NUM_THREADS is set). Each job gets its own
        rendezvous port: one closed just before may still be in TIME_WAIT."""
        self._port += 1
        env = {**os.environ}
        env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(2)))
        procs, logs = [], []
        try:
            for k, ns in enumerate(self.names):
                logs.append((tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")))
                argv = [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    str(BIN / "dist-infer"),
                    "launch",
                    "--hostfile",
                    str(self.hostfile),
                    "--node-rank",
                    str(k),
                    "--master-port",
                    str(self._port),
                    "--",
                    *command,
                ]
                procs.append(
                    subprocess.Popen(
                        argv, stdout=logs[-1][0], stderr=logs[-1][1], env=env, text=True, start_new_session=True
                    )
                )
            code = _wait_all(procs, timeout)
        finally:
            _stop(procs)
        texts = []
        for out, err in logs:
            out.seek(0)
            err.seek(0)
            texts.append((out.read(), err.read()))
            out.close()
            err.close()
        stderr = "".join(f"--- node {k} ---\n{err[-1500:]}" for k, (_, err) in enumerate(texts))
        return subprocess.CompletedProcess(command, code, texts[0][0], stderr)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> int:
    """Wait for every process; the first non-zero exit code (124 on the timeout) as soon as one fails."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            return 124
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each launcher still running (it passes it on to its ranks), SIGKILL 40 s later."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=40)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _limit_rate(ns: str, veth: str, rate: str) -> None:
    """A tbf of `rate` on `veth`'s egress, with a bucket of 1 ms of traffic (at least 64 KiB, so one
    GSO packet fits) and up to 50 ms of queue."""
    burst = max(rate_bits_per_s(rate) // 8 // 1000, 65536)
    _ip(
        "netns",
        "exec",
        ns,
        "tc",
        "qdisc",
        "add",
        "dev",
        veth,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        str(burst),
        "latency",
        "50ms",
    )


@contextmanager
def two_hosts(link_rate: Optional[str] = None) -> Iterator[TwoHosts]:
    """Namespaces A (10.231.X.1) and B (10.231.X.2) joined by a veth pair, removed on the way out."""
    if link_rate is not None:
        rate_bits_per_s(link_rate)  # a bad rate fails before anything is built
    pid = os.getpid()
    x = pid % 250 + 1
    names = [f"dist-infer-bench-{pid}-{side}" for side in "ab"]
    veths = [f"db{pid % 1000000}{side}" for side in "ab"]  # interface names: 15 characters at most
    addrs = [f"10.231.{x}.1", f"10.231.{x}.2"]
    created: list[str] = []
    workdir = Path(tempfile.mkdtemp(prefix="netns-hosts-"))
    try:
        for name in names:
            _ip("netns", "add", name)
            created.append(name)
        _ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for name, veth, addr in zip(names, veths, addrs):
            _ip("link", "set", veth, "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", name, "link", "set", veth, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            if link_rate is not None:
                _limit_rate(name, veth, link_rate)
        hostfile = workdir / "hosts"
        hostfile.write_text(f"# two network namespaces, one rank each\n{addrs[0]} slots=1\n{addrs[1]} slots=1\n")
        yield TwoHosts(names, addrs, veths, hostfile, link_rate)
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        # a veth still in the root namespace (set-up failed half way) goes with its peer
        subprocess.run(["ip", "link", "del", veths[0]], capture_output=True, timeout=30)
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()

"""A one-host Slurm for the tests: munged, slurmctld and slurmd of Debian's slurm-wlm (22.05), every
file under one temporary folder (key, socket, config, state, logs) and every daemon on 127.0.0.1 on
ports free at start, so nothing of the host's own Slurm or munge (if any) is read or touched.

The node claims more CPUs than the host has (SlurmdParameters=config_overrides), so `srun -n 4` and
a two-task allocation with a step beside its front end fit a 2-core machine; no cgroups, no
accounting (proctrack/linuxproc, task/none). `make slurm` installs the packages where apt-get can
(`python tests/support/slurm_cluster.py up` starts one by hand and waits for Ctrl-C).

The daemons run in the foreground as our children and are stopped by their process ids.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "sinfo", "squeue", "scancel")
INSTALL_HINT = "make slurm installs Debian's slurm-wlm and munge with apt-get where it can (root, or sudo -n)"


class SlurmUnavailable(RuntimeError):
    """No Slurm can run here; the message says why (the tests skip with it)."""


def missing_programs() -> list[str]:
    return [name for name in DAEMONS + CLIENTS + ("munge",) if _which(name) is None]


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(root: Path, node: str, user: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    """slurm.conf for one node, `node`, on 127.0.0.1 (pure)."""
    return "\n".join(
        [
            "ClusterName=distinfer-test",
            f"SlurmctldHost={node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge/munge.socket",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=10",
            f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs={cpus} RealMemory=4096 State=UNKNOWN",
            f"PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "",
        ]
    )


class OneHostSlurm:
    """Start with start(), use env() for every srun/salloc/sbatch, end with stop()."""

    def __init__(self, root: Path, cpus: int = 8):
        self.root, self.cpus = Path(root), cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self, base: Optional[dict] = None) -> dict[str, str]:
        """`base` (default os.environ) with SLURM_CONF pointing at this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def start(self, timeout: float = 30.0) -> "OneHostSlurm":
        if missing_programs():
            raise SlurmUnavailable(f"Slurm is not installed here (no {', '.join(missing_programs())}); {INSTALL_HINT}")
        for sub in ("munge", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(slurm_conf(self.root, self.node, getpass.getuser(), self.cpus, _free_port(), _free_port()))
        m = self.root / "munge"
        self._daemon(
            "munged",
            [
                "-F",
                "-f",
                f"--key-file={key}",
                f"--socket={m}/munge.socket",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/seed",
            ],
        )
        try:
            self._wait(lambda: (m / "munge.socket").exists(), timeout, "munged's socket")
            self._daemon("slurmctld", ["-D", "-c", "-i"])
            self._daemon("slurmd", ["-D", "-N", self.node])
            self._wait(self._idle, timeout, f"node {self.node} idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _daemon(self, name: str, args: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(
            [_which(name), *args],
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def _idle(self) -> bool:
        out = subprocess.run(
            [_which("sinfo"), "--noheader", "--Node", "--format", "%t"],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split()
        return out == ["idle"]

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"no {what} within {timeout:g} s"
                raise SlurmUnavailable(f"the one-host Slurm did not start ({why}):\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, tail: int = 1500) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if path.is_file():
                out.append(f"--- {path.name}:\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def stop(self) -> None:
        """End every job, then the daemons in reverse order (TERM, then KILL after 10 s)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(
                [_which("scancel"), "--full", "--user", getpass.getuser()],
                env=self.env(),
                capture_output=True,
                timeout=10,
            )
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


if __name__ == "__main__":
    if sys.argv[1:] != ["up"]:
        sys.exit(__doc__)
    import tempfile

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the finally below stops the daemons
    cluster = OneHostSlurm(Path(tempfile.mkdtemp(prefix="dist-infer-slurm-"))).start()
    print(f"export SLURM_CONF={cluster.conf}  # Ctrl-C or SIGTERM stops it", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()

"""Starting the processes of a server: each instance as a job of its own, and the front end as a
child of a launched job's world rank 0.

- `dist-infer serve` outside any launcher: the front end starts each instance as a job of its own
  (`serve --join`, our launcher for its ranks; `LocalSpawner`), the same way it restarts a dead
  instance or adds one. The job runs the serve command's own model and engine flags, without the
  API's (`instance_argv`), and joins the front end's hub with the key in $DIST_INFER_HUB_KEY.
- under torchrun, mpirun, srun or our `launch`: the job's ranks are the instances, and world rank 0
  starts the front end as a child process (`serve --frontend-only`; `start_frontend_child`), which
  writes its hub's address to $DIST_INFER_HUB_FILE and waits for the job's drivers to join.

Both run `python -m dist_infer serve ...` command lines; nothing here imports the CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loguru import logger

from dist_infer.arg_types import strip_flag
from dist_infer.serving.placement.rank_budget import RankBudget, local_capacity
from dist_infer.topology.cores import threads_per_rank, usable_cores
from dist_infer.topology.discovery import without_launcher_env

HUB_KEY_ENV = "DIST_INFER_HUB_KEY"  # the API's connection key, for instances that join it
HUB_FILE_ENV = "DIST_INFER_HUB_FILE"  # --frontend-only writes its hub's address here for the job's rank 0
# flags of the front end that an instance started as a job of its own does not take
API_ONLY_FLAGS = (
    "--instances",
    "--host",
    "--port",
    "--ready-file",
    "--nproc",
    "--dispatch",
    "--migrate-interval",
    "--migration-timeout",
    "--max-queue",
    "--served-model-name",
    "--join",
    "--instance-index",
    "--hub-key-file",
    "--backend",
    "--hostfile",
    "--hub-host",
    "--max-request-failovers",
    "--kv-mirror",
    "--kv-mirror-fraction",
    "--max-instances",
    "--max-ranks",
    "--api-key",
    "--admin-key",
    "--allowed-origins",
    "--max-body-bytes",
    "--max-connections",
    "--header-timeout",
    "--keep-alive-timeout",
    "--allowed-hosts",
    "--ssl-keyfile",
    "--ssl-certfile",
    "--ssl-ca-certs",
    "--ssl-cert-reqs",
    "--placement",
    "--ray-address",
    "--auto-restart",
    "--ray-cpus-per-rank",
    "--autoscale",
    "--slo",
    "--autoscale-cooldown",
    "--autoscale-down-after",
    "--autoscale-window",
    "--prefix-cache-isolation",
)
API_ONLY_SWITCHES = ("--frontend-only", "--protect-metrics")  # the same, for flags that take no value


def instance_argv(argv: list[str], index: int, spec, hub: tuple, drop=API_ONLY_FLAGS) -> list[str]:
    """The command line of a job that runs instance `index` alone and joins the hub: the serve
    command's own model and engine flags, without the API's (pure; unit tested)."""
    args = list(argv[argv.index("serve") + 1 :] if "serve" in argv else argv)
    for flag in drop:
        args = strip_flag(args, flag)
    args = [a for a in args if a not in API_ONLY_SWITCHES]
    return [
        "serve",
        *args,
        "--instances",
        spec.describe(),
        "--join",
        f"{hub[0]}:{hub[1]}",
        "--instance-index",
        str(index),
    ]


class LocalSpawner:
    """Start instance i as a job of its own on this host (our launcher, its own world), joining the hub.
    Each job's launcher would give its ranks every core of the host, so instances side by side
    would oversubscribe it, each running far slower than alone (docs/benchmarks.md, "Automatic prefix
    caching, cache-aware dispatch, and migrations that send only what is missing"):
    each rank gets the host's cores shared over the fleet's `local_ranks`, unless OMP_NUM_THREADS
    is set. A restarted instance takes the same share; one added later does too."""

    def __init__(self, argv: list[str], hub: tuple, key: bytes, local_ranks: int = 1):
        self.argv, self.hub, self.key = argv, hub, key
        self.threads = str(threads_per_rank(local_ranks))

    def __call__(self, index: int, spec) -> subprocess.Popen:
        command = [sys.executable, "-m", "dist_infer", *instance_argv(self.argv, index, spec, self.hub)]
        env = without_launcher_env(os.environ)
        env[HUB_KEY_ENV] = self.key.decode()
        env.pop(HUB_FILE_ENV, None)
        env.setdefault("OMP_NUM_THREADS", self.threads)
        logger.info(f"instance {index}: {' '.join(command)}")
        # its own session: a Ctrl-C at the terminal reaches the API, which stops the instances in order
        return subprocess.Popen(command, env=env, start_new_session=True)

    def rank_capacity(self) -> RankBudget:
        """The ranks this host holds: its usable cores (--max-ranks' default for local jobs)."""
        return local_capacity(usable_cores())


def start_frontend_child(argv: list[str], hub_host: str, key: bytes, timeout: float) -> tuple[subprocess.Popen, tuple]:
    """World rank 0 of a launched job: start the front end as a process of its own and wait for its
    hub's address. -> (the process, (host, port))."""
    hub_file = Path(tempfile.mkdtemp(prefix="dist-infer-hub-")) / "hub.json"
    args = list(argv[argv.index("serve") + 1 :] if "serve" in argv else argv)
    command = [sys.executable, "-m", "dist_infer", "serve", *args, "--frontend-only", "--hub-host", hub_host]
    env = without_launcher_env(os.environ)
    env[HUB_KEY_ENV], env[HUB_FILE_ENV] = key.decode(), str(hub_file)
    process = subprocess.Popen(command, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while not (hub_file.is_file() and hub_file.read_text().strip()):
        if process.poll() is not None:
            raise RuntimeError(f"the front end exited with code {process.returncode} before it listened")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"the front end did not listen within {timeout:g} s")
        time.sleep(0.05)
    info = json.loads(hub_file.read_text())
    hub_file.unlink()
    hub_file.parent.rmdir()
    return process, (info["host"], info["port"])


def write_hub_file(address: tuple) -> None:
    """--frontend-only: tell the job's rank 0 where the hub listens, whole or not at all (it polls)."""
    if not os.environ.get(HUB_FILE_ENV):
        return
    path = Path(os.environ[HUB_FILE_ENV])
    path.with_suffix(".tmp").write_text(json.dumps({"host": address[0], "port": address[1]}))
    os.replace(path.with_suffix(".tmp"), path)

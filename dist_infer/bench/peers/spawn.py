"""Starting a peer from the bench: its own processes (torchrun for the distributed ones), one peer at a
time on the machine, its result read back from the JSON it writes."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from dist_infer.bench.peers.llama_cpp import PEER as LLAMA_CPP, llama_repeats, run_llama_cpp
from dist_infer.bench.peers.metrics import failed
from dist_infer.bench.peers.runners import DEFAULT_TIMEOUT_S, DISTRIBUTED_PEERS, PEERS
from dist_infer.topology.discovery import free_port, without_launcher_env
from dist_infer.topology.processes import stop_process_groups

LOCK_PATH = os.path.join(tempfile.gettempdir(), "dist_infer_peers.lock")


def torchrun_argv(nproc: int, port: int) -> list[str]:
    """torchrun from the venv of this interpreter (or `python -m torch.distributed.run`)."""
    exe = Path(sys.executable).parent / "torchrun"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return base + [f"--nproc-per-node={nproc}", "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}"]


def peer_argv(
    peer: str,
    model_path: str,
    nproc: int,
    batch: int,
    prompt_len: int,
    gen_len: int,
    json_out: str,
    port: int,
    threads: Optional[int] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    repeats: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
) -> list[str]:
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; one of {', '.join(PEERS)}")
    tail = [
        "-m",
        "dist_infer.bench.peers",
        "--peer",
        peer,
        "--model",
        str(model_path),
        "--batch",
        str(batch),
        "--prompt-len",
        str(prompt_len),
        "--gen-len",
        str(gen_len),
        "--json-out",
        str(json_out),
        "--timeout",
        str(timeout_s),
        "--repeats",
        str(repeats),
    ]
    if threads:
        tail += ["--threads", str(threads)]
    if (device, dtype) != ("cpu", "float32"):
        tail += ["--device", device, "--dtype", dtype]
    if peer in DISTRIBUTED_PEERS:
        return torchrun_argv(nproc, port) + tail
    return [sys.executable] + tail


@contextmanager
def _exclusive(lock_path: str = LOCK_PATH):
    """One peer at a time on this machine, across threads and processes (they would fight for the cores)."""
    import fcntl

    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_ds_shm(port: int) -> None:
    """DeepSpeed's shm all-reduce leaves one /dev/shm segment per rank, named after MASTER_PORT."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        if re.search(rf"_{port}_\d+$", path):
            try:
                os.unlink(path)
            except OSError:
                pass


def _tail(text: str, n: int = 4000) -> str:
    text = text.strip()
    return text[-n:]


def run_peer(
    peer: str,
    model_path: str,
    nproc: int,
    batch: int,
    prompt_len: int,
    gen_len: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads: Optional[int] = None,
    env: Optional[dict[str, str]] = None,
    repeats: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict:
    """Run one peer in its own process(es) and return its metrics dict (ok False + stderr tail on failure).

    `hf` is one plain process (`nproc` is ignored; `threads` defaults to all cores); `hf-tp` and
    `deepspeed` run as `nproc` torchrun ranks (threads per rank default to cores // nproc). Peers
    started through here never overlap: a file lock serialises them. `llama.cpp` runs llama.cpp's
    own benchmark binary (`peers.llama_cpp`) with `threads` cores (default: all usable ones).
    `device` and `dtype` apply to `hf` alone (on `cuda`, the same GPU our run used); the others
    run the fp32 CPU workload.
    """
    if peer == LLAMA_CPP:
        with _exclusive():
            load_before = os.getloadavg()[0]
            measured = run_llama_cpp(model_path, batch, prompt_len, gen_len, threads, llama_repeats(repeats), timeout_s)
            measured["loadavg_1m"] = [load_before, os.getloadavg()[0]]
            return measured
    if peer not in PEERS:
        return failed(peer, f"unknown peer {peer!r}; one of {', '.join(PEERS + (LLAMA_CPP,))}")
    tp = nproc if peer in DISTRIBUTED_PEERS else 1
    with tempfile.TemporaryDirectory(prefix=f"peer-{peer}-") as tmp, _exclusive():
        json_out = os.path.join(tmp, "metrics.json")
        port = free_port()
        argv = peer_argv(
            peer,
            model_path,
            nproc,
            batch,
            prompt_len,
            gen_len,
            json_out,
            port,
            threads,
            timeout_s,
            repeats,
            device,
            dtype,
        )
        load_before = os.getloadavg()[0]
        rc, timed_out, wall, stdout, stderr = _run_child(argv, _child_env(port, device, env), tmp, timeout_s)
        if peer == "deepspeed":
            _remove_ds_shm(port)
        metrics = _outcome(peer, json_out, rc, timed_out, timeout_s, tp)
        if not metrics.get("ok"):
            metrics["stderr_tail"] = _tail(stderr) or _tail(stdout)
        metrics["command"] = " ".join(argv)
        metrics["wall_s"] = wall
        # 1-minute load average around the run: above the core count, other work shared the cores
        metrics["loadavg_1m"] = [load_before, os.getloadavg()[0]]
        return metrics


def _child_env(port: int, device: str, env: Optional[dict[str, str]]) -> dict[str, str]:
    """The peer's environment: a job of its own on the loopback rendezvous, able to import this
    package, with `env` over it."""
    child_env = without_launcher_env(os.environ)  # we may ourselves be a rank: the peer is a job of its own
    child_env.update(
        {
            "DS_ACCELERATOR": "cpu",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if device == "cpu":
        child_env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU workload: the same fp32 run on every CPU peer
    # the package must be importable by the child even when it is not installed
    root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
    if env:
        child_env.update(env)
    return child_env


def _run_child(
    argv: list[str], child_env: dict[str, str], tmp: str, timeout_s: float
) -> tuple[Optional[int], bool, float, str, str]:
    """Run the peer in a session of its own, its process group stopped at the timeout: (exit code,
    timed out, wall seconds, stdout, stderr), its output kept in files under `tmp`, not pipes."""
    out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    t0 = time.perf_counter()
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        proc = subprocess.Popen(argv, stdout=out_f, stderr=err_f, env=child_env, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_process_groups([proc], grace=5.0)
            rc = proc.returncode
    wall = time.perf_counter() - t0
    return rc, timed_out, wall, Path(out_path).read_text(errors="replace"), Path(err_path).read_text(errors="replace")


def _outcome(peer: str, json_out: str, rc: Optional[int], timed_out: bool, timeout_s: float, tp: int) -> dict:
    """The metrics the peer wrote, marked failed if it timed out or exited non-zero; a failure's
    metrics of our own if it wrote none."""
    metrics: Optional[dict] = None
    if os.path.exists(json_out):
        try:
            metrics = json.loads(Path(json_out).read_text())
        except ValueError:
            metrics = None
    if metrics is None:
        why = f"timed out after {timeout_s:.0f}s" if timed_out else f"exited with code {rc} and wrote no metrics"
        return failed(peer, f"{peer} {why}", tp=tp)
    if timed_out or rc != 0:
        metrics["ok"] = False
        if not metrics.get("error"):
            metrics["error"] = f"{peer} exited with code {rc}" + (" (timed out)" if timed_out else "")
    return metrics

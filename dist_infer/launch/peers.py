"""Peer runners for `dist-infer bench --compare`: the same greedy workload through other stacks.

Three peers, each run in its own process(es) so that none shares threads, memory or a process
group with another (or with us):

- ``hf``        HF transformers, one process, ``torch.set_num_threads(threads)``;
- ``hf-tp``     HF transformers' own tensor parallelism (``tp_plan="auto"``, DTensor over gloo),
                one rank per torchrun process;
- ``deepspeed`` DeepSpeed-Inference AutoTP (``init_inference(..., replace_with_kernel_inject=False)``)
                over gloo plus DeepSpeed's shared-memory all-reduce kernel, one rank per torchrun process.

The workload is identical for all three and timed by the same loop (`time_greedy`): B seeded
random prompts of exactly P token ids in [3, vocab); prefill = one forward over the B x P batch
(``ttft_s``, ``prefill_tok_s = B*P/ttft_s``); then G-1 greedy decode steps through a
``DynamicCache`` (``tpot_s`` = mean step time, ``decode_tok_s = B/tpot_s``). fp32, CPU,
``torch.inference_mode()``, one untimed warm-up (a short prefill and 2 decode steps) first;
``--repeats N`` times the workload N times and keeps the best ttft and mean step time (the estimate
least disturbed by other work on a shared machine).
The prefill asks the model for the last position's logits only (``logits_to_keep=1``), as a serving
engine would; every peer gets the same call.

Metrics (one dict per peer, written as JSON by rank 0)::

    {"peer", "prefill_tok_s", "decode_tok_s", "ttft_s", "tpot_s", "peak_rss_mb", "tp", "ok", "error",
     "token_ids" (B x G greedy ids), "peak_rss_mb_total", "load_s", "threads", "batch", "prompt_len",
     "gen_len", "world_size", "versions", "repeats", "ttft_s_all", "tpot_s_all"}

`run_peer` adds "command", "wall_s", "loadavg_1m" (before, after) and, on failure, "stderr_tail".

Started by the bench through `run_peer` (one peer at a time, never concurrently), or by hand::

    python -m dist_infer.launch.peers --peer hf --model DIR --batch 4 --prompt-len 256 --gen-len 32 --json-out hf.json
    torchrun --nproc-per-node 2 -m dist_infer.launch.peers --peer deepspeed --model DIR ... --json-out ds.json

What the CPU setup needs (found by reading the installed sources):

- DeepSpeed under torchrun: `deepspeed.init_distributed` JIT-builds and loads its shared-memory
  all-reduce op (``deepspeed_shm_comm``), and `inference_all_reduce` then calls it for every
  row-parallel layer. The op only maps its shared-memory workspace when the env var ``LOCAL_SIZE``
  equals the world size, and DeepSpeed's own launcher sets ``LOCAL_SIZE`` but torchrun does not (it
  sets ``LOCAL_WORLD_SIZE``); the kernel then runs on unmapped buffers and every rank dies with
  SIGSEGV in its first forward. We set ``LOCAL_SIZE`` from ``LOCAL_WORLD_SIZE`` before
  `init_distributed`, which is what ``deepspeed``'s launcher would have done. The segments it leaves
  in /dev/shm (``deepspeed_allreduce_buffer_*_<port>_<rank>``) are removed by `run_peer`. With ranks
  on several hosts the op cannot map them at all, so there we force DeepSpeed's gloo fallback
  (``cdb.shm_vector_kernel_level = 0``, the flag `inference_all_reduce` checks). The first run on a
  machine JIT-compiles the op (about 1-2 minutes on 2 cores; cached in ~/.cache/torch_extensions).
- transformers 5 deprecates ``from_pretrained(tp_plan=...)`` in favour of
  ``distributed_config=DistributedConfig(tp_plan="auto")``; we use the latter where it exists. HF TP
  picks its device from ``torch._C._get_accelerator()`` and the gloo backend for CPU, so it runs on
  CPU as is; `run_peer` hides any GPU (``CUDA_VISIBLE_DEVICES=""``, ``DS_ACCELERATOR=cpu``) so
  that all peers run the same fp32 CPU workload.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from dist_infer.launch.launcher import stop_process_groups, threads_per_rank
from dist_infer.models.checkpoint import peak_rss_mb
from dist_infer.topology.discovery import without_launcher_env

PEERS = ("hf", "hf-tp", "deepspeed")
DISTRIBUTED_PEERS = ("hf-tp", "deepspeed")
PROMPT_SEED = 1234
MIN_TOKEN_ID = 3            # ids below this are often special (pad/bos/eos): prompts avoid them
WARMUP_PROMPT_LEN = 16
WARMUP_DECODE_STEPS = 2
DEFAULT_TIMEOUT_S = 1800.0
LOCK_PATH = os.path.join(tempfile.gettempdir(), "dist_infer_peers.lock")


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------

def empty_metrics(peer: str, tp: int = 1, error: Optional[str] = None) -> dict[str, Any]:
    """The metrics dict with every key of the convention present; ok False until filled in."""
    return {
        "peer": peer,
        "prefill_tok_s": None,
        "decode_tok_s": None,
        "ttft_s": None,
        "tpot_s": None,
        "peak_rss_mb": None,
        "tp": tp,
        "ok": False,
        "error": error,
    }


def failed(peer: str, error: str, tp: int = 1, **extra: Any) -> dict[str, Any]:
    out = empty_metrics(peer, tp, error)
    out.update(extra)
    return out


def _versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "deepspeed"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "?")
    return out


# ---------------------------------------------------------------------------------------------
# the workload and its timing loop (shared by every peer)
# ---------------------------------------------------------------------------------------------

def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = PROMPT_SEED):
    """B x P token ids in [MIN_TOKEN_ID, vocab), the same on every rank and in every peer."""
    import torch

    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids >= {MIN_TOKEN_ID}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(MIN_TOKEN_ID, vocab_size, (batch, prompt_len), generator=gen, dtype=torch.long)


def _greedy(forward: Callable, config, input_ids, decode_steps: int, on_step=None):
    """Prefill `input_ids`, then `decode_steps` greedy steps; returns (tokens B x (1+steps), times)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    t0 = time.perf_counter()
    out = forward(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1, :].argmax(dim=-1)
    times = [time.perf_counter() - t0]
    tokens = [nxt]
    for _ in range(decode_steps):
        t0 = time.perf_counter()
        out = forward(input_ids=nxt[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1, :].argmax(dim=-1)
        times.append(time.perf_counter() - t0)
        tokens.append(nxt)
    expected = input_ids.shape[1] + decode_steps
    if cache.get_seq_length() != expected:
        raise RuntimeError(f"KV cache holds {cache.get_seq_length()} positions after the loop, expected {expected}")
    return torch.stack(tokens, dim=1), times


def time_greedy(forward: Callable, config, batch: int, prompt_len: int, gen_len: int,
                barrier: Optional[Callable[[], None]] = None, repeats: int = 1) -> dict[str, Any]:
    """The timed workload, identical for every peer. `forward` is the model (or engine) call.

    With `repeats` > 1 the timed run is repeated and the best (smallest) ttft and mean step time are
    kept: on a shared machine the minimum is the estimate least disturbed by other work.
    """
    import torch

    if batch < 1 or prompt_len < 1 or gen_len < 1 or repeats < 1:
        raise ValueError("batch, prompt_len, gen_len and repeats must be >= 1")
    vocab = config.get_text_config(decoder=True).vocab_size if hasattr(config, "get_text_config") else config.vocab_size
    prompts = make_prompts(batch, prompt_len, vocab)
    ttfts: list[float] = []
    tpots: list[float] = []
    tokens = None
    with torch.inference_mode():
        # Untimed warm-up: allocator, thread pool, first-call paths, the process group's first collectives.
        _greedy(forward, config, prompts[:, : min(prompt_len, WARMUP_PROMPT_LEN)], WARMUP_DECODE_STEPS)
        for _ in range(repeats):
            if barrier is not None:
                barrier()
            run_tokens, times = _greedy(forward, config, prompts, gen_len - 1)
            if tokens is None:
                tokens = run_tokens
            elif not torch.equal(tokens, run_tokens):
                raise RuntimeError("greedy tokens changed between repeats of the same workload")
            ttfts.append(times[0])
            if len(times) > 1:
                tpots.append(sum(times[1:]) / (len(times) - 1))
    ttft = min(ttfts)
    tpot = min(tpots) if tpots else None
    return {
        "ttft_s": ttft,
        "prefill_tok_s": batch * prompt_len / ttft,
        "tpot_s": tpot,
        "decode_tok_s": (batch / tpot) if tpot else None,
        "token_ids": tokens.tolist(),
        "repeats": repeats,
        "ttft_s_all": ttfts,
        "tpot_s_all": tpots,
    }


# ---------------------------------------------------------------------------------------------
# the peers (each runs inside its own process; the distributed ones on every rank)
# ---------------------------------------------------------------------------------------------

def _dist_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _finish(peer: str, tp: int, threads: int, load_s: float, timing: dict, batch: int, prompt_len: int,
            gen_len: int, world_size: int) -> dict[str, Any]:
    rss = peak_rss_mb()
    rss_max, rss_total = rss, rss
    if world_size > 1:
        import torch
        import torch.distributed as dist

        t = torch.tensor([rss, rss], dtype=torch.float64)
        mx = t[:1].clone()
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        tot = t[1:].clone()
        dist.all_reduce(tot, op=dist.ReduceOp.SUM)
        rss_max, rss_total = float(mx.item()), float(tot.item())
    out = empty_metrics(peer, tp)
    out.update(timing)
    out.update(
        ok=True,
        error=None,
        peak_rss_mb=rss_max,            # the largest rank's peak
        peak_rss_mb_total=rss_total,    # summed over the ranks
        load_s=load_s,
        threads=threads,
        batch=batch,
        prompt_len=prompt_len,
        gen_len=gen_len,
        world_size=world_size,
        versions=_versions(),
    )
    return out


def _init_gloo(timeout_s: float) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def hf_from_pretrained(model_path: str, **kwargs):
    """transformers' model from a checkpoint directory or a GGUF file (dequantized to fp32, the
    same weights ours loads)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dist_infer.models.gguf_checkpoint import is_gguf

    path = Path(model_path)
    if not is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    # transformers marks a GGUF-loaded model quantized although its weights are plain fp32 by now, and
    # then refuses .float(), which DeepSpeed's init_inference calls: clear the mark (nothing is quantized).
    if getattr(model, "is_quantized", False) and all(p.dtype == torch.float32 for p in model.parameters()):
        model.is_quantized = False
        model.hf_quantizer = None
    return model


def run_hf(model_path: str, batch: int, prompt_len: int, gen_len: int, threads: Optional[int] = None,
           repeats: int = 1) -> dict:
    """HF transformers in this one process."""
    import torch

    threads = threads or threads_per_rank(1)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = hf_from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    timing = time_greedy(model, model.config, batch, prompt_len, gen_len, repeats=repeats)
    return _finish("hf", 1, threads, load_s, timing, batch, prompt_len, gen_len, 1)


def run_hf_tp(model_path: str, batch: int, prompt_len: int, gen_len: int, threads: Optional[int] = None,
              timeout_s: float = DEFAULT_TIMEOUT_S, repeats: int = 1) -> dict:
    """HF transformers' tensor parallelism over WORLD_SIZE ranks (run under torchrun, gloo on CPU)."""
    import torch
    import torch.distributed as dist

    _, world = _dist_env()
    threads = threads or threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    torch.set_num_threads(threads)
    _init_gloo(timeout_s)  # transformers would do the same (gloo for a CPU accelerator); ours sets the timeout
    t0 = time.perf_counter()
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers < 5: the plain keyword
        tp_kwargs: dict[str, Any] = {"tp_plan": "auto"}
    else:
        tp_kwargs = {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=world)}
    model = hf_from_pretrained(model_path, dtype=torch.float32, **tp_kwargs)
    model.eval()
    load_s = time.perf_counter() - t0
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    if world > 1 and not sharded:
        raise RuntimeError("from_pretrained(tp_plan='auto') returned an unsharded model (no DTensor parameters)")
    timing = time_greedy(model, model.config, batch, prompt_len, gen_len, barrier=dist.barrier, repeats=repeats)
    return _finish("hf-tp", world, threads, load_s, timing, batch, prompt_len, gen_len, world)


def run_deepspeed_autotp(model_path: str, batch: int, prompt_len: int, gen_len: int,
                         threads: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                         repeats: int = 1) -> dict:
    """DeepSpeed-Inference AutoTP over WORLD_SIZE ranks (run under torchrun; gloo + DeepSpeed's shm all-reduce)."""
    import torch

    _, world = _dist_env()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # DeepSpeed's shm all-reduce maps its workspace only if LOCAL_SIZE == world size (its own launcher
    # sets it, torchrun does not); without it the kernel segfaults on the first forward.
    os.environ["LOCAL_SIZE"] = str(local_world)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    threads = threads or threads_per_rank(local_world)
    torch.set_num_threads(threads)

    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=timeout_s), verbose=False)
    if local_world != world:
        # Ranks on several hosts: the shm op stays unmapped, yet inference_all_reduce would still call it
        # (it only checks the CPU's ISA level). Force its gloo fallback, torch.distributed.all_reduce.
        import deepspeed.comm.comm as ds_comm

        if ds_comm.cdb is not None and hasattr(ds_comm.cdb, "shm_vector_kernel_level"):
            ds_comm.cdb.shm_vector_kernel_level = 0
    t0 = time.perf_counter()
    model = hf_from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                      replace_with_kernel_inject=False)
    load_s = time.perf_counter() - t0
    torch.set_num_threads(threads)  # in case anything above changed it
    timing = time_greedy(engine, engine.module.config, batch, prompt_len, gen_len, barrier=dist.barrier,
                         repeats=repeats)
    return _finish("deepspeed", world, threads, load_s, timing, batch, prompt_len, gen_len, world)


RUNNERS: dict[str, Callable[..., dict]] = {
    "hf": run_hf,
    "hf-tp": run_hf_tp,
    "deepspeed": run_deepspeed_autotp,
}


# ---------------------------------------------------------------------------------------------
# the per-rank command line
# ---------------------------------------------------------------------------------------------

def _write_json(path: str, data: dict) -> None:
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dist_infer.launch.peers",
                                description="Run one peer (hf, hf-tp, deepspeed) on the bench workload; "
                                            "rank 0 writes the metrics JSON.")
    p.add_argument("--peer", choices=PEERS, required=True)
    p.add_argument("--model", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--gen-len", type=int, required=True)
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores // local ranks)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after the warm-up; the best is reported")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="process-group timeout in seconds")
    p.add_argument("--json-out", required=True)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world = _dist_env()
    if args.peer in DISTRIBUTED_PEERS and "RANK" not in os.environ:
        err = f"--peer {args.peer} must be started by torchrun (no RANK/WORLD_SIZE in the environment)"
        _write_json(args.json_out, failed(args.peer, err, tp=world))
        print(err, file=sys.stderr)
        return 2
    if args.peer == "hf" and world > 1:
        err = "--peer hf runs as one process; start it without torchrun (or with --nproc-per-node 1)"
        if rank == 0:
            _write_json(args.json_out, failed(args.peer, err, tp=1))
        print(err, file=sys.stderr)
        return 2
    kwargs: dict[str, Any] = {"threads": args.threads, "repeats": args.repeats}
    if args.peer in DISTRIBUTED_PEERS:
        kwargs["timeout_s"] = args.timeout
    try:
        metrics = RUNNERS[args.peer](args.model, args.batch, args.prompt_len, args.gen_len, **kwargs)
    except Exception as exc:  # report it; a peer that cannot run is a result, not a crash of the bench
        traceback.print_exc()
        if rank == 0:
            _write_json(args.json_out, failed(args.peer, f"{type(exc).__name__}: {exc}",
                                              tp=world if args.peer in DISTRIBUTED_PEERS else 1,
                                              versions=_versions()))
        return 1
    if rank == 0:
        _write_json(args.json_out, metrics)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return 0


# ---------------------------------------------------------------------------------------------
# starting a peer from the bench
# ---------------------------------------------------------------------------------------------

def _free_port() -> int:
    try:
        from dist_infer.topology.discovery import free_port
    except ImportError:  # keep this module usable on its own
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return free_port()


def torchrun_argv(nproc: int, port: int) -> list[str]:
    """torchrun from the venv of this interpreter (or `python -m torch.distributed.run`)."""
    exe = Path(sys.executable).parent / "torchrun"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return base + [f"--nproc-per-node={nproc}", "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}"]


def peer_argv(peer: str, model_path: str, nproc: int, batch: int, prompt_len: int, gen_len: int,
              json_out: str, port: int, threads: Optional[int] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
              repeats: int = 1) -> list[str]:
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; one of {', '.join(PEERS)}")
    tail = ["-m", "dist_infer.launch.peers", "--peer", peer, "--model", str(model_path), "--batch", str(batch),
            "--prompt-len", str(prompt_len), "--gen-len", str(gen_len), "--json-out", str(json_out),
            "--timeout", str(timeout_s), "--repeats", str(repeats)]
    if threads:
        tail += ["--threads", str(threads)]
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


def run_peer(peer: str, model_path: str, nproc: int, batch: int, prompt_len: int, gen_len: int,
             timeout_s: float = DEFAULT_TIMEOUT_S, threads: Optional[int] = None,
             env: Optional[dict[str, str]] = None, repeats: int = 1) -> dict:
    """Run one peer in its own process(es) and return its metrics dict (ok False + stderr tail on failure).

    `hf` is one plain process (`nproc` is ignored; `threads` defaults to all cores); `hf-tp` and
    `deepspeed` run as `nproc` torchrun ranks (threads per rank default to cores // nproc). Peers
    started through here never overlap: a file lock serialises them.
    """
    if peer not in PEERS:
        return failed(peer, f"unknown peer {peer!r}; one of {', '.join(PEERS)}")
    tp = nproc if peer in DISTRIBUTED_PEERS else 1
    with tempfile.TemporaryDirectory(prefix=f"peer-{peer}-") as tmp, _exclusive():
        json_out = os.path.join(tmp, "metrics.json")
        port = _free_port()
        argv = peer_argv(peer, model_path, nproc, batch, prompt_len, gen_len, json_out, port, threads, timeout_s,
                         repeats)
        load_before = os.getloadavg()[0]
        child_env = without_launcher_env(os.environ)  # we may ourselves be a rank: the peer is a job of its own
        child_env.update({
            "CUDA_VISIBLE_DEVICES": "",      # every peer runs the same fp32 CPU workload
            "DS_ACCELERATOR": "cpu",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        })
        # the package must be importable by the child even when it is not installed
        root = str(Path(__file__).resolve().parents[2])
        child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, child_env.get("PYTHONPATH")]))
        if env:
            child_env.update(env)
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
        if peer == "deepspeed":
            _remove_ds_shm(port)
        stderr = Path(err_path).read_text(errors="replace")
        stdout = Path(out_path).read_text(errors="replace")
        metrics: Optional[dict] = None
        if os.path.exists(json_out):
            try:
                metrics = json.loads(Path(json_out).read_text())
            except ValueError:
                metrics = None
        if metrics is None:
            why = f"timed out after {timeout_s:.0f}s" if timed_out else f"exited with code {rc} and wrote no metrics"
            metrics = failed(peer, f"{peer} {why}", tp=tp)
        elif timed_out or rc != 0:
            metrics["ok"] = False
            if not metrics.get("error"):
                metrics["error"] = f"{peer} exited with code {rc}" + (" (timed out)" if timed_out else "")
        if not metrics.get("ok"):
            metrics["stderr_tail"] = _tail(stderr) or _tail(stdout)
        metrics["command"] = " ".join(argv)
        metrics["wall_s"] = wall
        # 1-minute load average around the run: above the core count, other work shared the cores
        metrics["loadavg_1m"] = [load_before, os.getloadavg()[0]]
        return metrics


if __name__ == "__main__":
    sys.exit(main())

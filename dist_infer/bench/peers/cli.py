"""The per-rank command line, `python -m dist_infer.bench.peers`: run one peer, rank 0 writes the JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any, Optional, Sequence

from dist_infer.bench.peers.metrics import failed, versions
from dist_infer.bench.peers.runners import (
    DEFAULT_TIMEOUT_S,
    DISTRIBUTED_PEERS,
    PEERS,
    RUNNERS,
    SINGLE_DEVICE_PEERS,
    dist_env,
)


def _write_json(path: str, data: dict) -> None:
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dist_infer.bench.peers",
        description="Run one peer (hf, hf-tp, deepspeed) on the bench workload; rank 0 writes the metrics JSON.",
    )
    p.add_argument("--peer", choices=PEERS, required=True)
    p.add_argument("--model", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--gen-len", type=int, required=True)
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores // local ranks)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs after the warm-up; the best is reported")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="process-group timeout in seconds")
    p.add_argument("--json-out", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the hf peer runs (the others: cpu)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the hf peer's weight dtype (the others: float32)",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rank, world = dist_env()
    if args.peer not in SINGLE_DEVICE_PEERS and (args.device, args.dtype) != ("cpu", "float32"):
        err = f"--peer {args.peer} runs fp32 on the CPU only; --device and --dtype apply to the hf peers"
        if rank == 0:
            _write_json(args.json_out, failed(args.peer, err, tp=world))
        print(err, file=sys.stderr)
        return 2
    if args.peer in DISTRIBUTED_PEERS and "RANK" not in os.environ:
        err = f"--peer {args.peer} must be started by torchrun (no RANK/WORLD_SIZE in the environment)"
        _write_json(args.json_out, failed(args.peer, err, tp=world))
        print(err, file=sys.stderr)
        return 2
    if args.peer in SINGLE_DEVICE_PEERS and world > 1:
        err = f"--peer {args.peer} runs as one process; start it without torchrun (or with --nproc-per-node 1)"
        if rank == 0:
            _write_json(args.json_out, failed(args.peer, err, tp=1))
        print(err, file=sys.stderr)
        return 2
    kwargs: dict[str, Any] = {"threads": args.threads, "repeats": args.repeats}
    if args.peer in SINGLE_DEVICE_PEERS:
        kwargs.update(device=args.device, dtype=args.dtype)
    if args.peer in DISTRIBUTED_PEERS:
        kwargs["timeout_s"] = args.timeout
    try:
        metrics = RUNNERS[args.peer](args.model, args.batch, args.prompt_len, args.gen_len, **kwargs)
    except Exception as exc:  # report it; a peer that cannot run is a result, not a crash of the bench
        traceback.print_exc()
        if rank == 0:
            _write_json(
                args.json_out,
                failed(
                    args.peer,
                    f"{type(exc).__name__}: {exc}",
                    tp=world if args.peer in DISTRIBUTED_PEERS else 1,
                    versions=versions(),
                ),
            )
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

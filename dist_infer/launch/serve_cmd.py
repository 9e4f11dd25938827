"""`dist-infer serve`: the model over the job's ranks behind an OpenAI-compatible HTTP API.

Rank 0 hosts the API and drives the step loop; every other rank follows the step plans. On
SIGTERM the server stops accepting, lets running requests finish (or aborts them after a
grace period), tells the other ranks to stop, and exits 0. If the engine fails (a rank died,
a wait timed out) the server exits non-zero with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Optional

from loguru import logger

KV_CACHE_MEMORY_DEFAULT = "1G"


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    from dist_infer.launch.cli import parse_size
    from dist_infer.launch.model_options import add_model_flags, add_scheduler_flags

    add_model_flags(p)
    add_scheduler_flags(p, offline=False)
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default %(default)s; 0: a free one, logged)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the checkpoint directory's name)")
    p.add_argument("--kv-cache-memory", type=parse_size, default=KV_CACHE_MEMORY_DEFAULT,
                   help="memory per rank for the KV cache when --kv-blocks is not given, e.g. 512M, 2G "
                        "(default %(default)s)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="requests that may wait for admission; past it new requests get HTTP 503 with Retry-After "
                        "(default %(default)s)")
    p.add_argument("--ready-file", default=None,
                   help="write {host, port, pid} as JSON to this file once the API accepts requests (for scripts)")


def default_kv_blocks(stage, block_size: int, memory_bytes: int, max_num_seqs: int) -> int:
    """Blocks that fit `memory_bytes` on this rank, at most enough for max_num_seqs full-length requests."""
    import torch

    kv_heads = max(1, stage.kv_heads_local)
    element = torch.empty((), dtype=stage.dtype).element_size()
    per_block = max(1, len(stage.layers)) * 2 * block_size * kv_heads * stage.cfg.head_dim * element
    enough = max_num_seqs * -(-stage.cfg.max_positions // block_size)
    return max(1, min(memory_bytes // per_block, enough))


def chat_template_of(model: str) -> Optional[str]:
    """tokenizer_config.json's chat_template (a string, or the 'default' one of a list), if any."""
    path = Path(model) / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, json.JSONDecodeError):
        return None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def run_serve(args) -> int:
    import torch

    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.launch.model_options import build_engine, load_model, scheduler_options
    from dist_infer.launch.rank import join_job
    from dist_infer.topology import ParallelConfig

    groups = join_job(args.backend, ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp),
                      args.timeout, args.iface, args.log_level, args.shm)
    world = groups.world
    stage, report, model = load_model(args, groups)
    options = scheduler_options(args)
    if options["num_blocks"] is None:  # every rank must use the same count: the smallest that fits everywhere
        mine = default_kv_blocks(stage, args.block_size, args.kv_cache_memory, args.max_num_seqs)
        blocks = torch.tensor([mine], dtype=torch.long)
        world.all_reduce(blocks, "min")
        options["num_blocks"] = int(blocks[0])
    tokenizer = None
    if world.rank == 0:
        try:
            tokenizer = TextTokenizer(model)
        except Exception as exc:  # noqa: BLE001 - token-id prompts still work
            logger.warning(f"no tokenizer ({exc}); only token-id prompts will be accepted")
    engine = build_engine(args, stage, groups, tokenizer=tokenizer, heartbeat_s=min(2.0, args.timeout / 4), **options)
    logger.info(f"loaded layers {report.layers[0]}..{report.layers[1] - 1} in {report.load_s:.2f} s; "
                f"KV cache {engine.num_blocks} blocks of {args.block_size} tokens")
    if world.rank != 0:
        for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 shuts the job down in order and tells us
            signal.signal(sig, lambda signum, _: logger.info(f"{signal.Signals(signum).name}: waiting for rank 0 to stop"))
        engine.follow()
        code = 0
    else:
        code = _serve_on_driver(args, engine, model, tokenizer)
    engine.close()
    groups.destroy()
    world.destroy()
    return code


def _serve_on_driver(args, engine, model: str, tokenizer) -> int:
    from dist_infer.serving.api_server import build_app, serve_http
    from dist_infer.serving.async_engine import AsyncEngine

    name = args.served_model_name or (Path(model).name if args.model not in (None, "default") else "default")

    def on_dead(reason: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the HTTP server shuts down; the exit code says why

    bridge = AsyncEngine(engine, name, tokenizer, chat_template_of(model), args.max_queue, on_dead=on_dead)
    bridge.start()
    app = build_app(bridge, name)

    def ready(host: str, port: int) -> None:
        logger.info(f"serving {name!r} on http://{host}:{port}/v1 (max {args.max_num_seqs} running, "
                    f"{args.max_batched_tokens} tokens per step)")
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps({"host": host, "port": port, "pid": os.getpid()}))

    serve_http(app, args.host, args.port, on_ready=ready)
    bridge.stop()
    if bridge.dead_reason is not None:
        logger.error(f"the server stopped because the engine failed: {bridge.dead_reason}")
        return 1
    logger.info("server stopped")
    return 0

"""`dist-infer generate`: load a checkpoint over the job and generate for a batch of prompts."""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from loguru import logger

from dist_infer.topology import discover

DEFAULT_PROMPT = "The quick brown fox"
# The serving step's token budget. On the 2-core CPU machine, the default model prefilling a
# 2040-token prompt in chunks beside 8 running decodes peaks at 256 tokens per step (3460 tok/s,
# 81 ms a step; 512: 3290 tok/s, 182 ms; 1024: 2490 tok/s, 578 ms): docs/benchmarks.md.
DEFAULT_MAX_BATCHED_TOKENS = 256
DEFAULT_DECODE_STALL_LIMIT = 0.0


def model_path(args) -> str:
    """--model, with 'default' (or nothing) meaning the built-in model, written on first use."""
    from dist_infer.models.default_model import ensure_default_model

    return str(ensure_default_model()) if args.model in (None, "default") else args.model


def scheduler_options(args) -> dict:
    return {"num_blocks": args.kv_blocks, "max_batched_tokens": args.max_batched_tokens,
            "max_num_seqs": args.max_num_seqs, "chunked_prefill": not args.no_chunked_prefill,
            "static_batching": args.scheduling == "static",
            "decode_stall_limit": getattr(args, "decode_stall_limit", 0) or None}


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model and how it is laid out: shared by generate and serve."""
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory (config.json, *.safetensors, tokenizer.json), or 'default': "
                        "the built-in small Llama, written to the cache on first use (the default)")
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many local ranks (default: tp x pp x ep x cp); ignored under torchrun/mpirun/launch")
    p.add_argument("--pp-split", default=None,
                   help="layers per pipeline stage, comma separated (default: balanced)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weight and activation dtype (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default %(default)s)")
    add_expert_placement_flag(p)
    add_cp_variant_flag(p)


def add_scheduler_flags(p: argparse.ArgumentParser, offline: bool) -> None:
    """The step loop's limits: shared by generate and serve (offline defaults: no budget, a cache for the batch)."""
    p.add_argument("--max-batched-tokens", type=int, default=None if offline else DEFAULT_MAX_BATCHED_TOKENS,
                   help="token budget of one forward step: running decodes first, then chunks of prompts up to it "
                        + ("(default: none, every prompt in one step)" if offline else
                           f"(default {DEFAULT_MAX_BATCHED_TOKENS}, measured on the 2-core CPU machine: "
                           "see docs/benchmarks.md)"))
    p.add_argument("--max-num-seqs", type=int, default=256 if offline else 64,
                   help="most requests running (holding KV blocks) at once (default %(default)s)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV cache blocks per rank (default: " + ("enough for the whole batch" if offline else
                        "what --kv-cache-memory holds, at most enough for --max-num-seqs full-length requests") + ")")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="compute each prompt in one step instead of in chunks under the token budget")
    if not offline:
        p.add_argument("--decode-stall-limit", type=float, default=DEFAULT_DECODE_STALL_LIMIT,
                       help="beside running decodes, cut prompt chunks so that a step takes about this many times a "
                            "decode-only step (from measured step times), keeping inter-token latency smooth while long "
                            "prompts are prefilled (2 meets Sarathi-Serve's p99/median ITL <= 2 on the CPU machine, at a "
                            "cost in TTFT and throughput under load: docs/benchmarks.md); 0: only --max-batched-tokens "
                            "cuts them (default %(default)s)")
    p.add_argument("--scheduling", choices=("continuous", "static"), default="continuous",
                   help="continuous: requests join and leave the batch at every step (default); static: a new batch "
                        "starts only when the whole running batch has finished (the baseline benchmarks compare with)")


def add_generate_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_scheduler_flags(p, offline=True)
    p.add_argument("--prompt", action="append", default=[], help="a text prompt; repeat for a batch")
    p.add_argument("--prompt-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids, e.g. 1,2,3; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (default), else sampling temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample only among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample only within this probability mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, the same on every rank (default %(default)s)")
    p.add_argument("--no-eos-stop", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--dump-logits", default=None, metavar="FILE",
                   help="save every step's logits (a list of [steps, vocab] fp32 tensors, one per prompt) to FILE "
                        "with torch.save, on rank 0; for checking against a reference")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object as the last stdout line on rank 0: outputs, parallel layout, timing")


def add_expert_placement_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-placement", default=None, metavar="FILE",
                   help="MoE models: which ep rank holds which experts, per layer, from a routing file written by "
                        "`dist-infer bench --save-routing` (default: contiguous, rank r holds experts r*E/ep..)")


def add_cp_variant_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp-variant", choices=("auto", "pass-kv", "pass-q"), default="auto",
                   help="with --cp > 1, the ring attention of the prefill: keys/values travel (pass-kv), queries "
                        "travel (pass-q), or chosen per prefill from the new and cached token counts (auto, default)")


def parse_prompt_ids(values: list[str]) -> list[list[int]]:
    out = []
    for text in values:
        try:
            ids = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"dist-infer generate: --prompt-ids {text!r} must be comma-separated integers")
        if not ids:
            raise SystemExit(f"dist-infer generate: --prompt-ids {text!r} is empty")
        out.append(ids)
    return out


def world_needed(args) -> int:
    return args.tp * args.pp * args.ep * args.cp


def spawn_local(args, argv: list[str]) -> Optional[int]:
    """Outside any launcher, start the ranks ourselves; returns the exit code, or None to run in-process."""
    if discover(os.environ) is not None:
        return None
    n = args.nproc or world_needed(args)
    if n == 1:
        return None
    from dist_infer.launch.launcher import relaunch_as_local_ranks
    from dist_infer.launch.logs import configure_logging
    from dist_infer.models.default_model import ensure_default_model

    configure_logging("launch")
    if args.model in (None, "default"):
        ensure_default_model()  # once, before the ranks race for it
    return relaunch_as_local_ranks(argv, n)


def overlap_options(args) -> dict:
    from dist_infer.engine.step_loop import DEFAULT_OVERLAP_THRESHOLD, DEFAULT_SEQUENCE_PARALLEL_THRESHOLD

    return {"overlap": args.overlap, "overlap_threshold": args.overlap_threshold or DEFAULT_OVERLAP_THRESHOLD,
            "sequence_parallel": args.sequence_parallel,
            "sequence_parallel_threshold": args.sequence_parallel_threshold or DEFAULT_SEQUENCE_PARALLEL_THRESHOLD}


def moe_report(stage, groups) -> Optional[dict]:
    """The routing statistics of an MoE model (collective: every rank calls it), None for a dense one."""
    from dist_infer.models.moe import is_moe_stage, routing_report

    return routing_report(stage, groups) if is_moe_stage(stage) else None


def run_generate(args) -> int:
    import torch

    from dist_infer.engine.step_loop import Engine
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.launch.rank import join_job
    from dist_infer.models.loader import load_stage
    from dist_infer.topology import ParallelConfig

    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                            stop_at_eos=not args.no_eos_stop)
    groups = join_job(args.backend, ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp),
                      args.timeout, args.iface, args.log_level, args.shm)
    world = groups.world
    model = model_path(args)
    split = [int(x) for x in args.pp_split.split(",")] if args.pp_split else None
    stage, report = load_stage(model, groups, getattr(torch, args.dtype), split, expert_placement=args.expert_placement)
    logger.info(f"loaded layers {report.layers[0]}..{report.layers[1] - 1} in {report.load_s:.2f} s, "
                f"peak RSS {report.peak_rss_mb:.0f} MiB")
    tokenizer = None
    prompts = parse_prompt_ids(args.prompt_ids)
    if args.prompt or not prompts:
        tokenizer = TextTokenizer(model)
        prompts = [tokenizer.encode(p) for p in (args.prompt or [DEFAULT_PROMPT])] + prompts
    engine = Engine(stage, groups, args.block_size, **overlap_options(args), cp_variant=args.cp_variant,
                    **scheduler_options(args))
    outputs = engine.generate(prompts, params, return_logits=bool(args.dump_logits))
    timing = {"load_s": report.load_s, **engine.timing.as_dict()}
    peaks = torch.zeros(world.size, dtype=torch.float64)
    peaks[world.rank] = report.peak_rss_mb
    world.all_reduce(peaks)
    moe = moe_report(stage, groups)
    if world.rank == 0:
        if tokenizer is None:
            try:
                tokenizer = TextTokenizer(model)
            except Exception:  # noqa: BLE001 - text is optional for id prompts
                tokenizer = None
        rows = []
        for o in outputs:
            text = tokenizer.decode(o.token_ids) if tokenizer else ""
            rows.append({"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids,
                         "logprobs": o.logprobs, "text": text, "finish_reason": o.finish_reason,
                         "preemptions": o.num_preemptions})
            prompt_text = tokenizer.decode(o.prompt_token_ids) if tokenizer else str(o.prompt_token_ids)
            print(f"--- prompt: {prompt_text!r}\n    output: {text!r}\n    ids: {o.token_ids}")
        print(f"timing: load {timing['load_s']:.2f} s, ttft {timing['ttft_s'] * 1e3:.1f} ms, "
              f"prefill {timing['prefill_tok_s']:.0f} tok/s, decode {timing['decode_tok_s']:.1f} tok/s")
        if moe is not None:
            from dist_infer.models.moe import format_routing_report

            print(format_routing_report(moe))
        if args.dump_logits:
            torch.save([torch.stack(o.logits) for o in outputs], args.dump_logits)
        if args.json:
            parallel = {"tp": args.tp, "pp": args.pp, "ep": args.ep, "cp": args.cp, "world_size": world.size,
                        "backend": world.backend, "mesh": groups.mesh.describe()}
            extra = {"moe": moe} if moe is not None else {}
            print(json.dumps({"outputs": rows, "parallel": parallel, "timing": timing,
                              "memory": {"peak_rss_mb_per_rank": peaks.tolist()}, **extra}))
    world.barrier()
    engine.close()
    groups.destroy()
    world.destroy()
    return 0

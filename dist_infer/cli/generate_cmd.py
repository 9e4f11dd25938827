"""`dist-infer generate`: load a checkpoint over the job and generate for a batch of prompts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from loguru import logger

from dist_infer.cli.structured_flags import add_structured_flags, structured_spec
from dist_infer.launch.model_options import (
    add_model_flags,
    add_scheduler_flags,
    build_engine,
    load_model,
    scheduler_options,
)

DEFAULT_PROMPT = "The quick brown fox"


def add_generate_flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_scheduler_flags(p, offline=True)
    p.add_argument("--prompt", action="append", default=[], help="a text prompt; repeat for a batch")
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=[],
        help="a prompt as comma-separated token ids, e.g. 1,2,3, or @FILE to read them from a file (a "
        "long prompt does not fit on a command line); repeat for a batch",
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 for greedy (default), else sampling temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample only among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample only within this probability mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, the same on every rank (default %(default)s)")
    p.add_argument("--no-eos-stop", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument(
        "--dump-logits",
        default=None,
        metavar="FILE",
        help="save every step's logits (a list of [steps, vocab] fp32 tensors, one per prompt) to FILE "
        "with torch.save, on rank 0; for checking against a reference",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object as the last stdout line on rank 0: outputs, parallel layout, timing",
    )
    add_structured_flags(p)


def parse_prompt_ids(values: list[str]) -> list[list[int]]:
    out = []
    for value in values:
        text, what = value, repr(value)
        if value.startswith("@"):
            try:
                text, what = Path(value[1:]).read_text(), value[1:]
            except OSError as exc:
                raise SystemExit(
                    f"dist-infer generate: --prompt-ids {value}: cannot read {value[1:]}: {exc.strerror or exc}"
                )
        try:
            ids = [int(x) for x in text.replace("\n", ",").split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"dist-infer generate: --prompt-ids {what[:200]} must be comma-separated integers")
        if not ids:
            raise SystemExit(f"dist-infer generate: --prompt-ids {what[:200]} is empty")
        out.append(ids)
    return out


def read_prompts(args, model: str):
    """The batch: --prompt texts (tokenized; the default prompt when none is given) then --prompt-ids.
    -> (token id lists, the tokenizer or None when no text was given)."""
    from dist_infer.engine.tokenizer import TextTokenizer

    tokenizer = None
    prompts = parse_prompt_ids(args.prompt_ids)
    if args.prompt or not prompts:
        tokenizer = TextTokenizer(model)
        prompts = [tokenizer.encode(p) for p in (args.prompt or [DEFAULT_PROMPT])] + prompts
    return prompts, tokenizer


def longest_prompt(args) -> int:
    """Tokens in the batch's longest prompt, read where the command starts (for --cp auto)."""
    from dist_infer.engine.tokenizer import TokenizerError
    from dist_infer.launch.model_options import model_path

    try:
        prompts, _ = read_prompts(args, model_path(args))
    except TokenizerError as exc:
        raise SystemExit(f"dist-infer generate: --cp auto needs the prompts' lengths: {exc}")
    return max(len(p) for p in prompts)


def cmd_generate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start the local ranks (outside a launcher, more than one needed), or run as one rank."""
    from dist_infer.cli.cp_auto import resolve_cp_auto
    from dist_infer.launch.rank import run_rank_command, spawn_local

    structured_spec(args)  # a spec that cannot be made fails here, once, not on every rank
    if args.cp == "auto":
        argv = resolve_cp_auto(args, list(argv), longest_prompt(args))
    code = spawn_local(args, list(argv))
    if code is not None:
        return code
    return run_rank_command(lambda: run_generate(args))


def sampling_params(args):
    """The batch's SamplingParams from the flags (a structured-output spec included)."""
    from dist_infer.engine.sampling import SamplingParams

    return SamplingParams(
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.seed,
        stop_at_eos=not args.no_eos_stop,
        structured=structured_spec(args),
    )


def run_generate(args) -> int:
    import torch

    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.launch.rank import join_job
    from dist_infer.models.checkpoint import peak_rss_mb
    from dist_infer.models.gguf.checkpoint import shared_parses
    from dist_infer.models.moe import moe_report
    from dist_infer.topology import Layout

    params = sampling_params(args)
    groups = join_job(
        args.backend,
        Layout(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp),
        args.timeout,
        args.iface,
        args.log_level,
        args.shm,
    )
    world = groups.world
    with shared_parses():  # a GGUF's weights and tokenizer share one parse of the file
        stage, report, model = load_model(args, groups)
        logger.info(
            f"loaded layers {report.layers[0]}..{report.layers[1] - 1} in {report.load_s:.2f} s, "
            f"peak RSS {report.peak_rss_mb:.0f} MiB"
        )
        prompts, tokenizer = read_prompts(args, model)
    engine = build_engine(args, stage, groups, **scheduler_options(args))
    outputs = engine.generate(prompts, params, return_logits=bool(args.dump_logits))
    timing = {"load_s": report.load_s, **engine.timing.as_dict()}
    peaks = torch.zeros(2, world.size, dtype=torch.float64)  # the whole run's peak, and the load's
    peaks[:, world.rank] = torch.tensor([peak_rss_mb(), report.peak_rss_mb], dtype=torch.float64)
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
            rows.append(
                {
                    "prompt_token_ids": o.prompt_token_ids,
                    "token_ids": o.token_ids,
                    "logprobs": o.logprobs,
                    "text": text,
                    "finish_reason": o.finish_reason,
                    "preemptions": o.num_preemptions,
                }
            )
            prompt_text = tokenizer.decode(o.prompt_token_ids) if tokenizer else str(o.prompt_token_ids)
            print(f"--- prompt: {prompt_text!r}\n    output: {text!r}\n    ids: {o.token_ids}")
        print(
            f"timing: load {timing['load_s']:.2f} s, ttft {timing['ttft_s'] * 1e3:.1f} ms, "
            f"prefill {timing['prefill_tok_s']:.0f} tok/s, decode {timing['decode_tok_s']:.1f} tok/s"
        )
        if moe is not None:
            from dist_infer.models.moe import format_routing_report

            print(format_routing_report(moe))
        speculative = speculative_summary(engine, args)
        if args.dump_logits:
            torch.save([torch.stack(o.logits) for o in outputs], args.dump_logits)
        if args.json:
            parallel = {
                "tp": args.tp,
                "pp": args.pp,
                "ep": args.ep,
                "cp": args.cp,
                "world_size": world.size,
                "backend": world.backend,
                "mesh": groups.mesh.describe(),
            }
            extra = {"moe": moe} if moe is not None else {}
            if speculative is not None:
                extra["speculative"] = speculative
            print(
                json.dumps(
                    {
                        "outputs": rows,
                        "parallel": parallel,
                        "timing": timing,
                        "memory": {
                            "peak_rss_mb_per_rank": peaks[0].tolist(),
                            "load_peak_rss_mb_per_rank": peaks[1].tolist(),
                        },
                        **extra,
                    }
                )
            )
    world.barrier()
    engine.close()
    groups.destroy()
    world.destroy()
    return 0


def speculative_summary(engine, args) -> dict | None:
    """--speculative's counters (printed), None when off."""
    if args.speculative == "off":
        return None
    s = engine.speculative.snapshot()
    print(
        f"speculative: {s['num_accepted_tokens']} of {s['num_draft_tokens']} proposed tokens accepted in {s['num_drafts']} rounds"
    )
    return s

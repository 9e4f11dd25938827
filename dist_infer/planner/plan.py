"""`dist-infer plan`: which layout for this model, these GPUs and this workload, and what latency
and memory to expect. Every layout of exactly --gpus ranks the engine can run is predicted by
the cost model (planner/predict.py) and those that fit in memory are ranked."""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from dist_infer.models.builtin import NAMES, resolve_model
from dist_infer.models.config import ModelConfig, ModelConfigError
from dist_infer.models.gguf.magic import is_gguf
from dist_infer.planner.engine_facts import OVERLAP_THRESHOLDS
from dist_infer.planner.hardware import HardwareProfile, ProfileError, load_profile
from dist_infer.planner.layout import LayoutError, candidate_layouts, parse_layout, why_not
from dist_infer.planner.predict import Prediction, predict
from dist_infer.planner.prefill_schedule import format_prefill_schedules, predict_prefill_schedules
from dist_infer.planner.shapes import ModelShape
from dist_infer.planner.workload import Schedule, Setup, Workload

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
PROFILE_ALIASES = {"h100": "h100-sxm"}
DTYPES = ("fp32", "bf16", "fp16", "fp8")
RANK_BY = ("e2e", "ttft", "tpot")


class PlanError(ValueError):
    """Bad input to plan or sweep; the message names the flag or file."""


def builtin_configs() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def model_config_dict(model: Optional[str]) -> tuple[dict, str]:
    """(HF config dict, where it came from) for a config.json, a checkpoint directory, a .gguf
    file, a built-in config name (e.g. llama3.1-405b) or a built-in model (default, tiny)."""
    if model in builtin_configs():
        path = os.path.join(CONFIG_DIR, f"{model}.json")
    elif model is None or model in NAMES:
        path = resolve_model(model)
    else:
        path = model
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise PlanError(
            f"--model {model}: no such file or directory (give a config.json, a checkpoint directory, "
            f"a .gguf file, or one of {', '.join(builtin_configs() + list(NAMES))})"
        )
    if is_gguf(path):
        from dist_infer.models.gguf.checkpoint import GGUFCheckpoint  # (the GGUF reader loads torch)

        with GGUFCheckpoint(path) as ckpt:
            return dict(ckpt.config), path
    try:
        with open(path) as f:
            return json.load(f), path
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None


def model_shape(model: Optional[str]) -> tuple[ModelShape, str]:
    cfg, path = model_config_dict(model)
    try:
        return ModelShape.from_config(ModelConfig.from_hf(cfg, path)), path
    except (ModelConfigError, KeyError, TypeError) as exc:
        raise PlanError(f"{path}: {exc}") from None


def resolve_profile(spec: str) -> HardwareProfile:
    try:
        return load_profile(PROFILE_ALIASES.get(spec, spec))
    except ProfileError as exc:
        raise PlanError(str(exc)) from None


def workload_from_args(args, hw: HardwareProfile) -> Workload:
    dtype = args.dtype or ("fp32" if hw.device == "cpu" else "bf16")
    return Workload(
        batch=args.batch,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        weight_dtype=dtype,
        mlp_dtype=args.mlp_dtype or "",
        act_dtype="fp32" if dtype == "fp32" else "bf16",
        attention_dtype="fp32" if dtype == "fp32" else "bf16",
        kv_dtype=args.kv_dtype or ("fp32" if dtype == "fp32" else "bf16"),
    )


def schedule_from_args(args, hw: HardwareProfile) -> Schedule:
    # a CPU profile's "devices" are cores: the job's ranks share one node unless told otherwise
    per_node = args.gpus_per_node or (args.gpus if hw.shared_node else hw.devices_per_node)
    threshold = OVERLAP_THRESHOLDS["cpu" if hw.device == "cpu" else "cuda"]  # the engine's --overlap auto
    return Schedule(
        overlap=args.overlap,
        overlap_threshold=threshold,
        ranks_per_node=per_node,
        cores_per_node=hw.devices_per_node if hw.shared_node else None,
    )


def rank_key(p: Prediction, by: str, gen_len: int) -> float:
    return {"ttft": p.ttft_s, "tpot": p.tpot_s, "e2e": p.ttft_s + max(0, gen_len - 1) * p.tpot_s}[by]


def plan_layouts(args) -> tuple[list[Prediction], list[tuple[str, str]], ModelShape, HardwareProfile, str]:
    """(predictions best first, [(layout, why it was left out)], shape, profile, model path)."""
    shape, path = model_shape(args.model)
    hw = resolve_profile(args.profile)
    work = workload_from_args(args, hw)
    sched = schedule_from_args(args, hw)
    skipped: list[tuple[str, str]] = []
    if args.layout:
        try:
            layout = parse_layout(args.layout)
        except LayoutError as exc:
            raise PlanError(f"--layout: {exc}") from None
        problem = why_not(layout, shape, args.gpus)
        if problem:
            raise PlanError(f"--layout {args.layout}: {problem}")
        layouts = [layout]
    else:
        layouts = candidate_layouts(shape, args.gpus)
        if not layouts:
            raise PlanError(
                f"no layout of {args.gpus} ranks can run {path} ({shape.heads} heads, {shape.layers} layers)"
            )
    preds = [predict(shape, lay, work, hw, sched) for lay in layouts]
    fitting = [p for p in preds if p.fits or args.layout]
    skipped += [
        (
            p.layout.describe(),
            f"needs {p.memory_gib_per_rank:.1f} GiB per rank, the profile has {hw.memory_bytes / 2**30:.1f}",
        )
        for p in preds
        if not p.fits and not args.layout
    ]
    fitting.sort(key=lambda p: rank_key(p, args.rank_by, args.gen_len))
    return fitting, skipped, shape, hw, path


def format_plan(preds: list[Prediction], skipped, shape: ModelShape, hw: HardwareProfile, path: str, args) -> str:
    per_node = schedule_from_args(args, hw).ranks_per_node
    lines = [
        f"plan: {os.path.basename(path)} ({shape.total_params() / 1e9:.2f}B parameters), {args.gpus} rank(s), "
        f"{per_node} per node, profile {hw.name}; batch {args.batch} x prompt "
        f"{args.prompt_len}, {args.gen_len} new tokens; ranked by {args.rank_by}",
        f"{'#':>2}  {'layout':<18}{'TTFT s':>10}{'TPOT ms':>10}{'GiB/rank':>10}  {'prefill bound by':<22}{'decode bound by'}",
    ]
    for i, p in enumerate(preds, 1):
        pf, dc = p.dominant_prefill, p.dominant_decode
        lines.append(
            f"{i:>2}  {p.layout.describe():<18}{p.ttft_s:>10.3f}{p.tpot_s * 1e3:>10.2f}"
            f"{p.memory_gib_per_rank:>10.2f}  {pf + f' {p.prefill[pf] / p.ttft_s:.0%}':<22}"
            f"{dc} {p.decode[dc] / p.tpot_s:.0%}" + ("" if p.fits else "  (does not fit)")
        )
    for lay, why in skipped:
        lines.append(f"    {lay:<18}left out: {why}")
    if preds:
        best = preds[0]
        terms = ", ".join(f"{k} {v:.3g} s" for k, v in sorted(best.prefill.items(), key=lambda kv: -kv[1])[:4])
        lines.append(
            f"best: {best.layout.describe()}: prefill {best.ttft_s:.3g} s ({terms}); "
            f"decode {best.tpot_s * 1e3:.3g} ms per step; {best.memory_gib_per_rank:.2f} GiB per rank "
            f"(weights {best.memory['weights']:.2f}, KV {best.memory['kv_cache']:.2f}, activations "
            f"{best.memory['activations']:.2f}, runtime {best.memory['runtime']:.2f}"
            + (
                f", shared-memory collectives {best.memory['comm_buffers']:.2f}"
                if best.memory.get("comm_buffers")
                else ""
            )
            + ")"
        )
    return "\n".join(lines)


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a config.json, a checkpoint directory, a .gguf file, a built-in config "
        f"({', '.join(builtin_configs())}) or model (default, tiny)",
    )
    p.add_argument("--gpus", type=int, required=True, help="ranks in the job (GPUs, or processes on CPU)")
    p.add_argument(
        "--gpus-per-node", type=int, default=None, help="ranks per node (default: the profile's devices per node)"
    )
    p.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt (default %(default)s)")
    p.add_argument("--gen-len", type=int, default=128, help="new tokens per prompt (default %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="prompts per batch (default %(default)s)")
    p.add_argument(
        "--profile",
        default="h100-sxm",
        help="hardware profile: a built-in name (h100 = h100-sxm, h100-meta-gtt) or a JSON file from "
        "`dist-infer calibrate` (default %(default)s)",
    )
    p.add_argument(
        "--layout", default=None, help="predict this one layout only, e.g. tp=8,cp=2 (the compact tp8cp2 also reads)"
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="weights and GEMMs (default: fp32 on a CPU profile, bf16 on a GPU profile)",
    )
    p.add_argument(
        "--mlp-dtype",
        choices=DTYPES,
        default=None,
        help="the MLP's GEMMs when they differ from --dtype (e.g. fp8 feed-forward weights)",
    )
    p.add_argument("--kv-dtype", choices=DTYPES, default=None, help="KV cache elements (default: as activations)")
    p.add_argument(
        "--overlap",
        choices=("on", "off", "auto"),
        default="auto",
        help="the engine's token-splitting overlap of tp all-reduces (as generate's --overlap)",
    )
    p.add_argument(
        "--rank-by",
        choices=RANK_BY,
        default="e2e",
        help="order: e2e (TTFT + (gen-len - 1) x TPOT, default), ttft or tpot",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=256,
        help="the serving step's token budget, for the prefill schedules' prediction (chunked against "
        "layered prefill of one --prompt-len prompt; default %(default)s, serve's)",
    )
    p.add_argument(
        "--running-decodes", type=int, default=8, help="decodes running beside that prompt (default %(default)s)"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"layouts": [{"tp", "pp", "cp", "ep", "ttft_s", "tpot_s", "memory_gib_per_rank", ...}]} best first',
    )


def check_plan_args(args) -> None:
    if args.max_batched_tokens <= args.running_decodes:
        raise PlanError(
            f"--max-batched-tokens {args.max_batched_tokens} leaves no room beside --running-decodes "
            f"{args.running_decodes}"
        )
    for flag in ("gpus", "prompt_len", "gen_len", "batch", "max_batched_tokens"):
        if getattr(args, flag) < 1:
            raise PlanError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise PlanError(f"--gpus-per-node must be positive, got {args.gpus_per_node}")


def run_plan(args) -> int:
    try:
        check_plan_args(args)
        preds, skipped, shape, hw, path = plan_layouts(args)
    except (PlanError, ValueError) as exc:
        print(f"dist-infer plan: {exc}")
        return 2
    if not preds:
        print(format_plan(preds, skipped, shape, hw, path, args))
        print(f"dist-infer plan: no layout of {args.gpus} ranks fits in {hw.memory_bytes / 2**30:.1f} GiB per rank")
        return 1
    print(format_plan(preds, skipped, shape, hw, path, args))
    best = preds[0].layout
    setup = Setup(shape, best, workload_from_args(args, hw), hw, schedule_from_args(args, hw))
    schedules = predict_prefill_schedules(setup, args.prompt_len, args.max_batched_tokens, args.running_decodes)
    print(format_prefill_schedules(schedules, best, args.prompt_len, args.max_batched_tokens, args.running_decodes))
    if args.json:
        print(
            json.dumps(
                {
                    "model": path,
                    "profile": hw.name,
                    "gpus": args.gpus,
                    "layouts": [p.as_dict() for p in preds],
                    "prefill_schedules": {k: v.as_dict() if v else None for k, v in schedules.items()},
                    "left_out": [{"layout": lay, "why": why} for lay, why in skipped],
                }
            )
        )
    return 0

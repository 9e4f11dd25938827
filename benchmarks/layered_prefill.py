"""Layered against chunked prefill on an MoE model, side by side in one run.

One engine in this process (tp=1, every core) serves D streams that decode throughout while K long
prompts arrive, one every --interval seconds; the same model and trace under
`--prefill-schedule chunked` and `layered`, alternating over rounds (the machine's speed drifts over
minutes). Per schedule (medians over rounds):

- expert-weight bytes read per long prompt: the routing statistics count an expert's weights read
  once per layer call that routes it a token; calls carrying prompt tokens (the prompt's own, and
  the decodes that share its layers) are the prompt's, divided by K;
- the running streams' inter-token gaps while the long prompts are in (p50, p99);
- the long prompts' TTFT (arrival to first token), and the tokens per second of the whole trace;
- what `dist-infer plan` predicts for both with this machine's profile (docs/profiles/cpu2-vm.json).

    python benchmarks/layered_prefill.py [--shape qwen-moe|mixtral] [--rounds 3] [--out FILE.json]

Random weights written with transformers (Qwen2-MoE or Mixtral config, scaled down to run here).
Nothing leaves the process but the `plan` subprocess. Check `uptime` before and after: figures count
on a quiet machine only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
SHAPES = {
    # Qwen1.5-MoE-A2.7B's pattern (60 experts, top-4, a shared expert) at a width this CPU runs
    "qwen-moe": (
        "qwen2_moe",
        dict(
            hidden_size=512,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=8,
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=1024,
            intermediate_size=1024,
            norm_topk_prob=False,
            vocab_size=32000,
        ),
    ),
    # Mixtral's pattern (8 experts, top-2, no shared expert)
    "mixtral": (
        "mixtral",
        dict(
            hidden_size=512,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=1408,
            vocab_size=32000,
        ),
    ),
}


def write_checkpoint(root: Path, name: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / name
    if not (path / "config.json").exists():
        model_type, shape = SHAPES[name]
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(model_type, max_position_embeddings=4096, tie_word_embeddings=False, **shape)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def build(path: str, schedule: str, args):
    from dist_infer.comm import build_groups, init_world
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.loader import load_stage
    from dist_infer.topology import Layout, Mesh

    world = init_world("gloo")
    groups = build_groups(world, Mesh.build(Layout(), world.size))
    stage, _ = load_stage(path, groups, torch.float32, None)
    engine = Engine(
        stage,
        groups,
        EngineConfig(
            block_size=16,
            num_blocks=args.kv_blocks,
            max_batched_tokens=args.budget,
            max_num_seqs=64,
            prefill_schedule=schedule,
        ),
    )
    return engine, stage


def run_trace(engine, stage, args) -> dict:
    """D decoding streams, then K long prompts at fixed wall-clock arrivals; the measurements."""
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.models.moe import expert_bytes

    gen = torch.Generator().manual_seed(1)
    vocab = stage.cfg.vocab_size
    long_new = SamplingParams(max_new_tokens=args.long_new, stop_at_eos=False)
    for i in range(args.decodes):
        engine.add_request(
            f"d{i}",
            torch.randint(3, vocab, (args.decode_prompt,), generator=gen).tolist(),
            SamplingParams(max_new_tokens=3000, stop_at_eos=False),
        )
    while len(engine.scheduler.running) < args.decodes or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()
    stage.reset_routing_stats()
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    start, arrivals, first, done, gaps, last_token = time.perf_counter(), {}, {}, {}, [], {}
    tokens = 0
    while len(done) < args.prompts:
        now = time.perf_counter() - start
        for k in range(args.prompts):
            if f"p{k}" not in arrivals and now >= k * args.interval:
                arrivals[f"p{k}"] = now
                engine.add_request(f"p{k}", prompts[k], long_new)
        for out in engine.step():
            t = time.perf_counter() - start
            tokens += len(out.new_token_ids)
            rid = out.request_id
            if rid.startswith("p"):
                first.setdefault(rid, t)
                if out.finished:
                    done[rid] = t
            elif out.new_token_ids:
                if rid in last_token and any(a <= t and rid_ not in done for rid_, a in arrivals.items()):
                    gaps.append(t - last_token[rid])
                last_token[rid] = t
    elapsed = time.perf_counter() - start
    for i in range(args.decodes):
        engine.abort(f"d{i}")
    while engine.has_unfinished():
        engine.step()
    reads = sum(s.expert_reads["prompt"] for s in stage.routing_stats().values())
    gaps.sort()
    return {
        "expert_bytes_per_prompt": reads * expert_bytes(stage.cfg, stage.dtype) / args.prompts,
        "itl_p50_s": gaps[len(gaps) // 2],
        "itl_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "ttft_s": statistics.median(first[k] - arrivals[k] for k in arrivals),
        "tokens_per_s": tokens / elapsed,
        "gaps": len(gaps),
        "elapsed_s": elapsed,
    }


def predicted(path: str, args) -> dict:
    cmd = [
        str(BIN / "dist-infer"),
        "plan",
        "--model",
        path,
        "--gpus",
        "1",
        "--profile",
        str(REPO / "docs" / "profiles" / "cpu2-vm.json"),
        "--prompt-len",
        str(args.prompt_len),
        "--max-batched-tokens",
        str(args.budget),
        "--running-decodes",
        str(args.decodes),
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        return {"error": out.stdout[-2000:] + out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])["prefill_schedules"]


def one_schedule(path: str, schedule: str, args) -> dict:
    """A fresh process per run: each schedule starts from the same cold state."""
    cmd = [sys.executable, __file__, "--child", schedule, "--model", path, *child_flags(args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{schedule} run failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_flags(args) -> list[str]:
    return [
        "--budget",
        str(args.budget),
        "--prompt-len",
        str(args.prompt_len),
        "--prompts",
        str(args.prompts),
        "--decodes",
        str(args.decodes),
        "--decode-prompt",
        str(args.decode_prompt),
        "--interval",
        str(args.interval),
        "--long-new",
        str(args.long_new),
        "--kv-blocks",
        str(args.kv_blocks),
        "--threads",
        str(args.threads),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen-moe")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=int, default=264, help="step token budget (8 decodes + 256 prompt tokens)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=4, help="long prompts in the trace")
    p.add_argument("--decodes", type=int, default=8, help="streams decoding throughout")
    p.add_argument("--decode-prompt", type=int, default=128)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between long prompts")
    p.add_argument("--long-new", type=int, default=8, help="tokens each long prompt generates")
    p.add_argument("--kv-blocks", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        torch.set_num_threads(args.threads)
        engine, stage = build(args.model, args.child, args)
        print(json.dumps(run_trace(engine, stage, args)))
        return
    path = write_checkpoint(Path(tempfile.gettempdir()) / "dist-infer-layered-bench", args.shape)
    runs = {"chunked": [], "layered": []}
    for r in range(args.rounds):
        order = ("chunked", "layered") if r % 2 == 0 else ("layered", "chunked")
        for schedule in order:
            runs[schedule].append(one_schedule(path, schedule, args))
            print(f"round {r + 1} {schedule}: {json.dumps(runs[schedule][-1])}", flush=True)
    med = {s: {k: statistics.median(x[k] for x in v) for k in v[0]} for s, v in runs.items()}
    ratio = {
        k: med["layered"][k] / med["chunked"][k]
        for k in ("expert_bytes_per_prompt", "itl_p50_s", "itl_p99_s", "ttft_s", "tokens_per_s")
    }
    result = {
        "shape": args.shape,
        "flags": vars(args),
        "median": med,
        "layered_over_chunked": ratio,
        "runs": runs,
        "predicted": predicted(path, args),
    }
    for s in ("chunked", "layered"):
        m = med[s]
        print(
            f"{s:<8} expert MiB/prompt {m['expert_bytes_per_prompt'] / 2**20:8.1f}  ITL p50 {m['itl_p50_s'] * 1e3:6.1f} ms"
            f"  p99 {m['itl_p99_s'] * 1e3:6.1f} ms  TTFT {m['ttft_s'] * 1e3:7.0f} ms  {m['tokens_per_s']:6.1f} tok/s"
        )
    print("layered / chunked: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))
    print(f"predicted: {json.dumps(result['predicted'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Prompts in bf16 (`--prompt-dtype`) against fp32 on the default model, in one process: the prefill
rate of a prompt, and how far bf16's generations move from fp32's.

- rate: a fresh random prompt of --prompt-len tokens prefilled (one new token) under each dtype in
  turn, --rounds alternating rounds (the machine drifts over minutes), the token budget the serve
  default (2048: one step for 1024 tokens; `--max-batched-tokens` to cut it); tokens per second.
- agreement: --prompts random prompts of --prompt-len tokens, --new greedy tokens each under both
  dtypes: how many generations are identical, for the others the first differing step and the fp32
  logit gap between the two tokens chosen there (a near tie), and the largest |bf16 - fp32| logit
  over the steps both took, against the largest |logit|.

    python benchmarks/prompt_dtype.py [--prompt-len 1024] [--rounds 5] [--prompts 16] [--new 64] [--json]

Needs a CPU with bf16 matrix instructions (amx_bf16 or avx512_bf16) and oneDNN: otherwise bfloat16
is refused and this says why. Check `uptime` before and after: figures count on a quiet machine only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _engine(prompt_dtype: str, budget: int):
    from dist_infer.comm.solo import solo_groups
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.models.builtin import smollm2_path
    from dist_infer.models.fused_decode import prompt_bf16
    from dist_infer.models.loader import load_stage

    groups = solo_groups()
    stage, _ = load_stage(str(smollm2_path()), groups, torch.float32)
    stage.prompt_bf16 = prompt_bf16(prompt_dtype, stage)
    return Engine(stage, groups, EngineConfig(max_batched_tokens=budget))


def rates(engines: dict, prompt_len: int, rounds: int, vocab: int) -> dict:
    from dist_infer.engine.sampling import SamplingParams

    got: dict[str, list[float]] = {name: [] for name in engines}
    gen = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        for name, engine in engines.items():
            prompt = torch.randint(100, vocab, (prompt_len,), generator=gen).tolist()
            began = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_new_tokens=1, stop_at_eos=False))
            got[name].append(prompt_len / (time.perf_counter() - began))
    return {name: {"tok_s": r, "median": statistics.median(r)} for name, r in got.items()}


def agreement(engines: dict, prompts: int, prompt_len: int, new: int, vocab: int) -> dict:
    from dist_infer.engine.sampling import SamplingParams

    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(100, vocab, (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
    params = SamplingParams(max_new_tokens=new, stop_at_eos=False)
    fp32, bf16 = (engines[n].generate(batch, params, return_logits=True) for n in ("float32", "bfloat16"))
    rows = []
    for a, b in zip(fp32, bf16):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        upto = new if first is None else first + 1
        la, lb = torch.stack(a.logits[:upto]), torch.stack(b.logits[:upto])
        row = {
            "identical": first is None,
            "max_logit_diff": float((la - lb).abs().max()),
            "scale": float(la.abs().max()),
        }
        if first is not None:
            row["first_differing_step"] = first
            row["fp32_gap_there"] = float(a.logits[first][a.token_ids[first]] - a.logits[first][b.token_ids[first]])
        rows.append(row)
    return {
        "identical": sum(r["identical"] for r in rows),
        "of": len(rows),
        "max_logit_diff_over_scale": max(r["max_logit_diff"] / r["scale"] for r in rows),
        "rows": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16, help="agreement: prompts generated under both dtypes")
    p.add_argument("--agreement-len", type=int, default=256, help="agreement: tokens per prompt")
    p.add_argument("--new", type=int, default=64, help="agreement: greedy tokens per prompt")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    print(f"uptime before: {os.getloadavg()}", file=sys.stderr)
    engines = {d: _engine(d, args.max_batched_tokens) for d in ("float32", "bfloat16")}
    vocab = engines["float32"].cfg.vocab_size
    out = {
        "rates": rates(engines, args.prompt_len, args.rounds, vocab),
        "agreement": agreement(engines, args.prompts, args.agreement_len, args.new, vocab),
    }
    r = out["rates"]
    out["bf16_over_fp32"] = r["bfloat16"]["median"] / r["float32"]["median"]
    print(f"uptime after: {os.getloadavg()}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    else:
        for name, v in r.items():
            print(f"{name}: prefill {args.prompt_len} tokens: " + ", ".join(f"{x:.0f}" for x in v["tok_s"]) + " tok/s")
        a = out["agreement"]
        print(f"bf16 / fp32: {out['bf16_over_fp32']:.2f}x; identical generations {a['identical']} of {a['of']}")
        print(f"largest |bf16 - fp32| logit / largest |logit|: {a['max_logit_diff_over_scale']:.4f}")
        for i, row in enumerate(a["rows"]):
            if not row["identical"]:
                print(
                    f"  prompt {i}: first differs at step {row['first_differing_step']}, fp32 gap {row['fp32_gap_there']:.4f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

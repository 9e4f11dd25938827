"""The library entry points: load or shard a model over the job, then generate."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from dist_infer.comm import ParallelGroups, build_groups, init_world
from dist_infer.engine.engine_core import Engine, EngineConfig, GenerationOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.speculative.config import SpeculativeConfig
from dist_infer.engine.structured.spec import StructuredSpec
from dist_infer.engine.tokenizer import TextTokenizer
from dist_infer.models.loader import load_stage, resolve_device, stage_from_hf_model
from dist_infer.topology import Layout, Mesh


class ShardedModel:
    """A model spread over this job's ranks; every rank calls `generate` with the same prompts."""

    def __init__(self, engine: Engine, groups: ParallelGroups, owns_world: bool = False):
        self.engine, self.groups = engine, groups
        self.config = engine.cfg
        self._owns_world = owns_world  # load/shard joined the job themselves: close() leaves it
        self._closed = False

    def close(self) -> None:
        """Release the engine's threads and groups, and the job's world if load/shard joined it
        (given `groups` stay the caller's). Idempotent; `with load(...) as model:` calls it."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        if self._owns_world:
            self.groups.destroy()
            self.groups.world.destroy()

    def __enter__(self) -> "ShardedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        return_logits: bool = False,
        structured: Optional[StructuredSpec] = None,
    ) -> list[GenerationOutput]:
        """`structured`: what every output must look like (StructuredSpec.from_kind("json_schema",
        schema), ...); it needs the model's tokenizer (load's, or the one given to shard)."""
        params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed, structured=structured)
        return self.engine.generate([list(p) for p in prompts], params, return_logits)


def join(
    parallel: Layout, backend: str = "auto", groups: Optional[ParallelGroups] = None
) -> tuple[ParallelGroups, bool]:
    """The caller's groups, or the job's joined here: (groups, whether they were joined here)."""
    if groups is not None:
        return groups, False
    world = init_world(backend)
    return build_groups(world, Mesh.build(parallel, world.size)), True


def shard(
    hf_model,
    parallel: Layout = Layout(),
    groups: Optional[ParallelGroups] = None,
    backend: str = "auto",
    pp_split: Optional[Sequence[int]] = None,
    block_size: int = 16,
    device: str = "cpu",
    quantization: str = "auto",
    ladder: Optional[str] = None,
    tokenizer: Optional[Any] = None,
    speculative: Optional[SpeculativeConfig] = None,
) -> ShardedModel:
    """Shard a transformers causal LM already in memory over the job (like deepspeed.init_inference);
    `device`: cpu, cuda (this rank's GPU) or auto. `quantization`: as the CLI's --quantization
    (auto: float weights for an in-memory model; int8 / int4: each rank quantizes its shard, CPU only).
    `ladder`: as --ladder-residual (all, FIRST:LAST, off; None: as the model's config says).
    `tokenizer`: the model's TextTokenizer, or its checkpoint path, for structured outputs (None: none).
    `speculative`: speculative decoding (engine/speculative; the CLI's --speculative), None: off."""
    groups, joined = join(parallel, backend, groups)
    stage = stage_from_hf_model(
        hf_model, groups, pp_split=pp_split, device=resolve_device(device), quantization=quantization, ladder=ladder
    )
    if tokenizer is None:
        load_tokenizer = None
    elif isinstance(tokenizer, TextTokenizer):
        load_tokenizer = lambda: tokenizer  # noqa: E731
    else:
        load_tokenizer = lambda: TextTokenizer(tokenizer)  # noqa: E731
    engine = Engine(
        stage, groups, EngineConfig(block_size=block_size, speculative=speculative), tokenizer=load_tokenizer
    )
    return ShardedModel(engine, groups, owns_world=joined)


def load(
    path,
    parallel: Layout = Layout(),
    groups: Optional[ParallelGroups] = None,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    pp_split: Optional[Sequence[int]] = None,
    block_size: int = 16,
    device: str = "cpu",
    quantization: str = "auto",
    ladder: Optional[str] = None,
    speculative: Optional[SpeculativeConfig] = None,
) -> ShardedModel:
    """Load a HF checkpoint directory (or GGUF file) over the job, each rank reading only its shard;
    `device`: cpu, cuda (this rank's GPU) or auto. `quantization`: as the CLI's --quantization (auto:
    a GGUF file's quantized tensors stay quantized on the CPU, a HF checkpoint loads as floats).
    `ladder`: as --ladder-residual (all, FIRST:LAST, off; None: as config.json's ladder_residual says).
    `speculative`: speculative decoding (engine/speculative; the CLI's --speculative), None: off."""
    groups, joined = join(parallel, backend, groups)
    stage, _ = load_stage(
        path, groups, dtype, pp_split, device=resolve_device(device), quantization=quantization, ladder=ladder
    )
    engine = Engine(
        stage,
        groups,
        EngineConfig(block_size=block_size, speculative=speculative),
        tokenizer=lambda: TextTokenizer(path),
    )
    return ShardedModel(engine, groups, owns_world=joined)

"""Which stage class builds which HF model_type. New families register here."""

from __future__ import annotations

from typing import Callable

from dist_infer.models.config import DENSE_TYPES, MOE_TYPES, ModelConfigError

# model_type -> callable(cfg, groups, layers, first, last, dtype, **options) -> stage module
_BUILDERS: dict[str, Callable] = {}


def register(*model_types: str):
    def deco(builder: Callable) -> Callable:
        for t in model_types:
            _BUILDERS[t] = builder
        return builder

    return deco


def builder_for(model_type: str) -> Callable:
    if model_type not in _BUILDERS:
        raise ModelConfigError(f"model_type {model_type!r} is not supported; supported: {sorted(_BUILDERS)}")
    return _BUILDERS[model_type]


@register(*DENSE_TYPES)
def _llama(cfg, groups, layers, first, last, dtype, expert_placement=None):
    from dist_infer.models.llama import LlamaStage

    if expert_placement is not None:
        raise ModelConfigError(f"an expert placement was given, but model_type {cfg.model_type!r} has no experts")
    if groups.ep.size > 1:
        raise ModelConfigError(
            f"ep={groups.ep.size} needs a mixture-of-experts model; model_type {cfg.model_type!r} has no experts"
        )
    return LlamaStage(cfg, groups.tp, layers, first=first, last=last, dtype=dtype, cp=groups.cp)


@register(*MOE_TYPES)
def _moe(cfg, groups, layers, first, last, dtype, expert_placement=None):
    from dist_infer.models.moe import MoEStage

    return MoEStage(cfg, groups, layers, first=first, last=last, dtype=dtype, placement=expert_placement)

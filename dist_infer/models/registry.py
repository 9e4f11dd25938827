"""Which stage class builds which HF model_type. New families register here."""

from __future__ import annotations

from typing import Callable

from dist_infer.models.config import SUPPORTED, ModelConfigError

# model_type -> callable(cfg, groups, layers, first, last, dtype) -> stage module
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


@register(*SUPPORTED)
def _llama(cfg, groups, layers, first, last, dtype):
    from dist_infer.models.llama import LlamaStage

    return LlamaStage(cfg, groups.tp, layers, first=first, last=last, dtype=dtype)

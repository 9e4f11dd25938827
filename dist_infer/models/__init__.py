"""Models built from the parallel layers (Llama family), and HF checkpoint loading.

The names below are imported on first use (PEP 562), so `dist_infer.models.builtin` (which the
launcher uses to find the model before starting ranks) loads without torch."""

from importlib import import_module

_WHERE = {"LlamaStage": "llama", "ModelConfig": "config", "ModelConfigError": "config"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"dist_infer.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dist_infer.models' has no attribute {name!r}")

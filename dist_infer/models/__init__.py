"""Models built from the parallel layers (Llama family), and HF checkpoint loading."""

from dist_infer.models.config import ModelConfig, ModelConfigError
from dist_infer.models.llama import LlamaStage

__all__ = ["LlamaStage", "ModelConfig", "ModelConfigError"]

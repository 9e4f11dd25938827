"""Generation: paged KV cache, sampling, the loop that drives the pipeline stages."""

from dist_infer.engine.api import ShardedModel, load, shard
from dist_infer.engine.generate import Engine, GenerationOutput, PromptError
from dist_infer.engine.sampling import SamplingParams

__all__ = ["Engine", "GenerationOutput", "PromptError", "SamplingParams", "ShardedModel", "load", "shard"]

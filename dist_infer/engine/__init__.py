"""The engine: paged KV cache, the iteration-level scheduler, sampling, the step loop."""

from dist_infer.engine.api import ShardedModel, load, shard
from dist_infer.engine.request import Request, RequestError, RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.step_loop import Engine, GenerationOutput, PromptError

__all__ = ["Engine", "GenerationOutput", "PromptError", "Request", "RequestError", "RequestOutput", "SamplingParams",
           "ShardedModel", "load", "shard"]

"""The engine: paged KV cache, the iteration-level scheduler, sampling, the step loop.

`Engine` (engine_core.py) composes the loop's jobs, one module each: intake.py (requests in),
driver_step.py (plan, launch, complete a step), request_progress.py (stops, text, deltas),
pipeline.py (transport between stages, the follower loop), offline_generate.py (`generate`).
"""

from dist_infer.engine.api import ShardedModel, load, shard
from dist_infer.engine.request import Request, RequestError, RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.engine_core import Engine, GenerationOutput, PromptError

__all__ = ["Engine", "GenerationOutput", "PromptError", "Request", "RequestError", "RequestOutput", "SamplingParams",
           "ShardedModel", "load", "shard"]

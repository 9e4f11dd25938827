"""The engine: paged KV cache, the iteration-level scheduler, sampling, the step loop.

`Engine` (engine_core.py) is the composition root of the loop's jobs, one object each, configured
by one `EngineConfig` (engine_config.py): intake.py (requests in), step_pacing.py (the ITL target,
step costs), pipeline.py (transport between ranks), stage_runner.py (a rank's share of a plan, the
follower loop), request_progress.py (stops, deltas), driver_step.py (plan, launch, complete a
step), offline_generate.py (`generate`), structured/ (structured outputs: grammars, token masks),
speculative/ (speculative decoding: proposals, their length, verification).
"""

from dist_infer.engine.api import ShardedModel, load, shard
from dist_infer.engine.engine_core import Engine, EngineConfig, GenerationOutput, PromptError, WorkerOptions
from dist_infer.engine.request import Request, RequestError, RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.engine.speculative.config import SpeculativeConfig
from dist_infer.engine.structured import StructuredSpec, StructuredSpecError

__all__ = [
    "Engine",
    "EngineConfig",
    "GenerationOutput",
    "PromptError",
    "Request",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "ShardedModel",
    "SpeculativeConfig",
    "StructuredSpec",
    "StructuredSpecError",
    "WorkerOptions",
    "load",
    "shard",
]

"""What an engine is asked to do, as one value: its scheduler's limits and its worker's options.

`Engine(stage, groups, EngineConfig(...))` takes this instead of a long list of keywords, so the
CLI (launch/model_options.py), the library and the tests build it once and the engine passes the
parts on. The checks here need nothing but the values (modes, numbers, the ITL target), so a bad
flag fails when the config is made; what depends on the model or the layout (context parallel,
layered prefill) is checked by the engine, which has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from dist_infer.arg_types import DEFAULT_PROMPT_MAX_WAIT_S, parse_itl_target
from dist_infer.engine.decode_graphs import check_graph_mode
from dist_infer.engine.layered_prefill import SCHEDULES, LayeredPrefill
from dist_infer.engine.prompt_order import check_policy
from dist_infer.engine.scheduler_config import SchedulerConfig
from dist_infer.engine.speculative.config import SpeculativeConfig
from dist_infer.models.cp_attention import CP_VARIANTS, ContextParallelError
from dist_infer.parallel.sequence_parallel import should_sequence_parallel
from dist_infer.parallel.token_split import should_split

# Tokens per step from which `--overlap auto` splits, per device kind (None: never). On a CPU
# splitting gained next to nothing at 1-2K tokens and lost much of an 8192-token prefill: a CPU rank
# has no spare core for the transfer to hide on (docs/benchmarks.md, "Token-splitting overlap: how
# much communication is hidden"). TokenWeave finds about 1024 on H100s.
OVERLAP_THRESHOLDS = {"cpu": None, "cuda": 1024}
DEFAULT_OVERLAP_THRESHOLD = OVERLAP_THRESHOLDS["cuda" if torch.cuda.is_available() else "cpu"]
# Tokens per step from which `--sequence-parallel auto` applies; None: auto never does. On a CPU
# it was within noise of plain tp in prefill and slower in decode (docs/benchmarks.md, the same
# section); on CUDA it is not measured yet, so auto leaves it off.
SEQUENCE_PARALLEL_THRESHOLDS = {"cpu": None, "cuda": None}
DEFAULT_SEQUENCE_PARALLEL_THRESHOLD = SEQUENCE_PARALLEL_THRESHOLDS["cuda" if torch.cuda.is_available() else "cpu"]
HEARTBEAT_S = 2.0  # an idle driver sends an empty plan this often, so the followers' waits never time out


def _at_least_one(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


@dataclass(frozen=True)
class WorkerOptions:
    """How every rank's worker runs a step (engine/worker.py), passed to it whole: token-splitting
    overlap and sequence parallel (on, off, or auto from a tokens-per-step threshold; None: auto
    never), the ring attention of a cp prefill, and CUDA graphs for decode steps
    (engine/decode_graphs.py: auto, on, off; padded runs the buckets eagerly)."""

    overlap: str = "off"
    overlap_threshold: Optional[int] = DEFAULT_OVERLAP_THRESHOLD
    sequence_parallel: str = "off"
    sequence_parallel_threshold: Optional[int] = DEFAULT_SEQUENCE_PARALLEL_THRESHOLD
    cp_variant: str = "auto"
    cuda_graphs: str = "auto"

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise naming the option that is not one of its modes, or a threshold below one token."""
        if self.cp_variant not in CP_VARIANTS:
            raise ContextParallelError(f"cp variant {self.cp_variant!r} is not one of {CP_VARIANTS}")
        should_split(self.overlap, 0, 1, self.overlap_threshold)  # validates the mode
        should_sequence_parallel(self.sequence_parallel, 0, 1, self.sequence_parallel_threshold)
        check_graph_mode(self.cuda_graphs)
        _at_least_one("overlap_threshold (--overlap-threshold)", self.overlap_threshold)
        _at_least_one("sequence_parallel_threshold (--sequence-parallel-threshold)", self.sequence_parallel_threshold)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings. num_blocks None: the cache is sized for each `generate` batch
    (offline). max_batched_tokens None: no token budget.
    itl_target: the inter-token latency a step beside running decodes keeps, its prompt chunk sized
    from step costs learned online (step_cost.py): 'auto' (twice the decode-only step), 'Nx' (N
    times it), 'MS' milliseconds, or None / 'off': only the token budget cuts prompts.
    prefix_caching: reuse the KV blocks of prompt prefixes computed before (prefix_cache.py); the
    engine turns it off, with an info line, under context parallel (cp shards blocks per rank). The
    CLI's --prefix-caching turns it on by default; the library default is off so that callers that
    time repeated runs of the same prompts (bench) measure computed prefills, not cache hits.
    prefill_schedule: 'chunked' cuts a prompt over the token budget into token chunks; 'layered'
    runs it whole, one group of `layer_groups` layer groups per step (None: as many as the budget
    needs; engine/layered_prefill.py). Layered needs pp=1, cp=1 and no ladder layers.
    heartbeat_s: how often an idle driver sends an empty plan (the followers' receive timeout).
    speculative: propose tokens and verify them in one step (engine/speculative); None: off. Off
    under cp and layered prefill (their steps take one token per decode)."""

    block_size: int = 16
    num_blocks: Optional[int] = None
    max_batched_tokens: Optional[int] = None
    max_num_seqs: int = 256
    chunked_prefill: bool = True
    watermark: float = 0.01
    static_batching: bool = False
    scheduling_policy: str = "fcfs"
    prompt_max_wait_s: float = DEFAULT_PROMPT_MAX_WAIT_S
    itl_target: Optional[str] = None
    prefix_caching: bool = False
    prefill_schedule: str = "chunked"
    layer_groups: Optional[int] = None
    heartbeat_s: float = HEARTBEAT_S
    worker: WorkerOptions = field(default_factory=WorkerOptions)
    speculative: Optional[SpeculativeConfig] = None

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise a ValueError naming the setting that no engine could run with."""
        for name in ("block_size", "num_blocks", "max_batched_tokens", "max_num_seqs", "layer_groups"):
            _at_least_one(name, getattr(self, name))
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be a fraction of the blocks in [0, 1), got {self.watermark}")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be positive, got {self.heartbeat_s}")
        if self.prefill_schedule not in SCHEDULES:
            raise ValueError(f"prefill schedule {self.prefill_schedule!r} is not one of {SCHEDULES}")
        parse_itl_target(self.itl_target)
        check_policy(self.scheduling_policy, self.prompt_max_wait_s)
        if not isinstance(self.worker, WorkerOptions):
            raise TypeError(f"worker must be WorkerOptions, got {type(self.worker).__name__}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be SpeculativeConfig or None, got {type(self.speculative).__name__}")

    @property
    def itl(self) -> Optional[tuple[str, float]]:
        """The ITL target as the step pacing takes it (arg_types.parse_itl_target)."""
        return parse_itl_target(self.itl_target)

    def scheduler_config(
        self, num_blocks: int, max_positions: int, cp: int, layered: Optional[LayeredPrefill]
    ) -> SchedulerConfig:
        """The scheduler's config for a cache of `num_blocks`, a model of `max_positions` and `cp`
        context-parallel ranks. Unchunked, any prompt must fit in one step, so the budget grows to
        the model's positions (vLLM's rule too); cp steps take whole prompts, with no prefix cache."""
        budget = self.max_batched_tokens
        if not self.chunked_prefill and budget is not None and budget < max_positions:
            budget = max_positions
        return SchedulerConfig(
            num_blocks=num_blocks,
            block_size=self.block_size,
            max_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            watermark=self.watermark,
            chunked_prefill=self.chunked_prefill and cp == 1,
            whole_prompt_steps=cp > 1,
            static_batching=self.static_batching,
            prefix_caching=self.prefix_caching and cp == 1,
            layered=layered if self.chunked_prefill else None,
            policy=self.scheduling_policy,
            max_wait_s=self.prompt_max_wait_s,
        )

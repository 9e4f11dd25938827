"""The engine: one step loop for serving and for offline generation.

The driver (world rank 0) owns the requests and the scheduler. Every step it builds a plan
(scheduler.py), sends it to the ranks of the first pipeline stage, and runs its own share;
each stage passes the plan on with its hidden states, and the last stage's sampler rank (the
driver's pipeline peer) samples the flagged rows and sends the tokens back. The other ranks
follow the plans and coordinate nothing else.

`Engine` is this module's set-up (the KV cache, the worker, the scheduler, migration) composed
with one mixin per job:

- intake.py: adding, resuming and aborting requests, the command queue, the registry, stats;
- driver_step.py: planning, launching and completing a step, and the serving loop;
- request_progress.py: a sampled token to its request: stop checks, detokenizing, output deltas;
- pipeline.py: sending plans, hidden states and sampled tokens between stages; the follower loop;
- offline_generate.py: `generate`, "submit everything, run the loop", and its timing.

A request can fail only itself (step_guard.py): an exception in what the driver alone does
(planning, sampling, stop checks) ends the requests concerned with an error and the loop goes on;
one in the forward, which every rank runs, still ends the instance (unless it is the only rank).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable, Optional

import torch
from loguru import logger

from dist_infer.comm.base import Communicator, Handle
from dist_infer.comm.groups import ParallelGroups
from dist_infer.comm.peer_link import PeerLink
from dist_infer.engine.malloc_tuning import tune_malloc
from dist_infer.engine.decode_graphs import check_graph_mode, graphs_wanted
from dist_infer.engine.device_io import module_device
from dist_infer.engine.driver_step import DriverStep, InFlightStep
from dist_infer.engine.intake import RequestIntake
from dist_infer.engine.kv_cache import PagedKVCache
from dist_infer.engine.kv_transfer import BlockMover, KVLayout, TransferOp
from dist_infer.engine.layered_prefill import SCHEDULES, LayeredPrefill
from dist_infer.engine.migration import MigrationEndpoint
from dist_infer.engine.offline_generate import OfflineGenerate, Timing
from dist_infer.engine.offline_outputs import GenerationOutput
from dist_infer.engine.pipeline import PipelineTransport
from dist_infer.engine.request import PromptError, Request
from dist_infer.engine.request_progress import RequestProgress
from dist_infer.engine.sampling import SampledTokens
from dist_infer.engine.scheduler import Scheduler, SchedulerConfig
from dist_infer.engine.step_cost import StepCostModel, StepTimes, parse_itl_target
from dist_infer.engine.step_guard import StepGuard
from dist_infer.engine.worker import StageWorker
from dist_infer.models.cp_attention import CP_VARIANTS, ContextParallelError
from dist_infer.parallel.sequence_parallel import should_sequence_parallel
from dist_infer.parallel.token_split import should_split

__all__ = ["DEFAULT_OVERLAP_THRESHOLD", "DEFAULT_SEQUENCE_PARALLEL_THRESHOLD", "Engine", "GenerationOutput",
           "HEARTBEAT_S", "OVERLAP_THRESHOLDS", "PromptError", "SEQUENCE_PARALLEL_THRESHOLDS", "Timing"]

# Tokens per step from which `--overlap auto` splits, per device kind (None: never). On the 2-core
# CPU machine splitting gained nothing at 1024 tokens and 2.5% at 2048, and lost 44% of an
# 8192-token prefill (1.48 s against 1.03 s at tp=2; docs/benchmarks.md, issue 15): a CPU rank has
# no spare core for the transfer to hide on. TokenWeave finds about 1024 on H100s.
OVERLAP_THRESHOLDS = {"cpu": None, "cuda": 1024}
DEFAULT_OVERLAP_THRESHOLD = OVERLAP_THRESHOLDS["cuda" if torch.cuda.is_available() else "cpu"]
# Tokens per step from which `--sequence-parallel auto` applies; None: auto never does. On the
# 2-core CPU machine it was within noise of plain tp at 1024 and 2048 tokens and slower in
# decode (docs/benchmarks.md); on CUDA it is unmeasured (no GPU yet), so auto leaves it off.
SEQUENCE_PARALLEL_THRESHOLDS = {"cpu": None, "cuda": None}
DEFAULT_SEQUENCE_PARALLEL_THRESHOLD = SEQUENCE_PARALLEL_THRESHOLDS["cuda" if torch.cuda.is_available() else "cpu"]
HEARTBEAT_S = 2.0  # an idle driver sends an empty plan this often, so the followers' waits never time out


class Engine(RequestIntake, DriverStep, RequestProgress, PipelineTransport, OfflineGenerate):
    """One model instance's step loop. Every rank constructs it; world rank 0 drives."""

    def __init__(self, stage, groups: ParallelGroups, block_size: int = 16,
                 overlap: str = "off", overlap_threshold: Optional[int] = DEFAULT_OVERLAP_THRESHOLD,
                 cp_variant: str = "auto",
                 sequence_parallel: str = "off",
                 sequence_parallel_threshold: Optional[int] = DEFAULT_SEQUENCE_PARALLEL_THRESHOLD,
                 num_blocks: Optional[int] = None, max_batched_tokens: Optional[int] = None,
                 max_num_seqs: int = 256, chunked_prefill: bool = True, watermark: float = 0.01,
                 static_batching: bool = False, itl_target: Optional[str] = None, prefix_caching: bool = False,
                 prefill_schedule: str = "chunked", layer_groups: Optional[int] = None,
                 heartbeat_s: float = HEARTBEAT_S, sampler: Optional[Callable[..., SampledTokens]] = None,
                 cuda_graphs: str = "auto"):
        """num_blocks None: sized for each `generate` batch (offline). max_batched_tokens None: no budget.
        itl_target: the inter-token latency a step beside running decodes keeps, its prompt chunk
        sized from step costs learned online (step_cost.py): 'auto' (twice the decode-only step),
        'Nx' (N times it), 'MS' milliseconds, or None / 'off': only the token budget cuts prompts.
        sampler: logits, rows, EOS ids -> SampledTokens on the sampler rank (None: sampling.sample_rows);
        the seam where a check without a device's values puts a fixed token.
        prefix_caching: reuse the KV blocks of prompt prefixes computed before (prefix_cache.py);
        turned off, with an info line, under context parallel (cp shards blocks per rank). The CLI's
        --prefix-caching turns it on by default; the library default is off so that callers that
        time repeated runs of the same prompts (bench) measure computed prefills, not cache hits.
        prefill_schedule: 'chunked' cuts a prompt over the token budget into token chunks; 'layered'
        runs it whole, one group of `layer_groups` layer groups per step (None: as many as the
        budget needs; engine/layered_prefill.py). Layered needs pp=1, cp=1 and no ladder layers.
        cuda_graphs: decode steps replayed from captured CUDA graphs, per batch-size bucket
        (engine/decode_graphs.py: auto, on, off; padded runs the buckets eagerly)."""
        self.itl_target = parse_itl_target(itl_target)
        if cp_variant not in CP_VARIANTS:
            raise ContextParallelError(f"cp variant {cp_variant!r} is not one of {CP_VARIANTS}")
        if groups.cp.size > 1 and groups.pp.size > 1:
            raise ContextParallelError(f"cp with pp is not supported yet (cp={groups.cp.size}, pp={groups.pp.size})")
        if groups.cp.size > 1 and getattr(stage, "cp", None) is None:
            raise ContextParallelError(f"cp={groups.cp.size}: {type(stage).__name__} has no context-parallel attention")
        should_split(overlap, 0, 1, overlap_threshold)  # validates the modes
        should_sequence_parallel(sequence_parallel, 0, 1, sequence_parallel_threshold)
        tune_malloc()
        self.stage, self.groups, self.block_size = stage, groups, block_size
        self.cfg = stage.cfg
        self.pp: Communicator = groups.pp
        self.cp = groups.cp
        self.is_driver = groups.world.rank == 0
        coords = groups.mesh.coords(groups.world.rank)
        self.is_sampler = self.pp.rank == self.pp.size - 1 and all(coords[a] == 0 for a in ("tp", "cp", "ep", "dp"))
        self.stage_comm = self._stage_group(groups)
        check_graph_mode(cuda_graphs)
        self.cuda_graphs = cuda_graphs
        self.worker_options = dict(overlap=overlap, overlap_threshold=overlap_threshold,
                                   sequence_parallel=sequence_parallel,
                                   sequence_parallel_threshold=sequence_parallel_threshold, cp_variant=cp_variant)
        self.fixed_blocks = num_blocks
        self.max_batched_tokens, self.max_num_seqs = max_batched_tokens, max_num_seqs
        self.chunked_prefill, self.watermark, self.static_batching = chunked_prefill, watermark, static_batching
        if prefix_caching and groups.cp.size > 1:
            if groups.world.rank == 0:
                logger.info(f"prefix caching is off: not supported with context parallel (cp={groups.cp.size})")
            prefix_caching = False
        self.prefix_caching = prefix_caching
        self.layered = layered_schedule(prefill_schedule, layer_groups, stage, groups)
        self.heartbeat_s = heartbeat_s
        self.step_costs = StepCostModel()  # what a step costs, learned from the steps run (driver)
        self.step_times = StepTimes()  # step durations by kind, for /metrics
        self._last_complete = 0.0
        self.timing = Timing()
        self.worker: Optional[StageWorker] = None
        self.scheduler: Optional[Scheduler] = None
        self._pending: list[Handle] = []
        self._inflight: deque[InFlightStep] = deque()
        self._requests: dict[str, Request] = {}
        self._commands: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._freed: list[int] = []
        self._transfers: list[TransferOp] = []  # KV block moves for the next plan (live migration)
        self.mover: Optional[BlockMover] = None
        self._follower_start: Optional[tuple[float, float]] = None
        self.migration: Optional[MigrationEndpoint] = None
        self._next_seq = 0
        self.requests_added = 0  # add commands applied (the API counts what it sent and has not been seen)
        self._step = 0
        self._last_plan = time.monotonic()
        self.return_logits = False
        self.guard = StepGuard(self._fail)
        self.sampler = sampler
        if num_blocks is not None:
            self._allocate(num_blocks)

    # -- set-up ---------------------------------------------------------------------------------
    @staticmethod
    def _stage_group(groups: ParallelGroups) -> Communicator:
        """The ranks of this rank's pipeline stage: the driver sends each plan to stage 0's."""
        if groups.pp.size == 1:
            return groups.world
        mesh = groups.mesh
        stages = [[r for r in range(mesh.world_size) if mesh.coords(r)["pp"] == s] for s in range(groups.pp.size)]
        return groups.world.split(stages, "stage")

    def _allocate(self, num_blocks: int, max_rows: Optional[int] = None) -> None:
        """The KV cache, worker and scheduler for `num_blocks` blocks; `max_rows`: the most sequences
        a step will hold (offline: the batch; default max_num_seqs), the largest decode bucket."""
        budget = self.max_batched_tokens
        if not self.chunked_prefill and budget is not None and budget < self.cfg.max_positions:
            budget = self.cfg.max_positions  # unchunked, any prompt must fit in one step (vLLM's rule too)
        kv_heads = max(1, self.stage.kv_heads_local)
        device = module_device(self.stage)
        graphs = graphs_wanted(self.cuda_graphs, device)
        cache = PagedKVCache(len(self.stage.layers), num_blocks, self.block_size, kv_heads, self.cfg.head_dim,
                             self.stage.dtype, device, scratch=graphs)
        rows = min(self.max_num_seqs, max_rows or self.max_num_seqs)
        self.worker = StageWorker(self.stage, self.groups, cache, self.block_size, **self.worker_options,
                                  cuda_graphs=self.cuda_graphs, max_rows=rows)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=self.block_size, max_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs, watermark=self.watermark,
            chunked_prefill=self.chunked_prefill and self.cp.size == 1, whole_prompt_steps=self.cp.size > 1,
            static_batching=self.static_batching, prefix_caching=self.prefix_caching,
            layered=self.layered if self.chunked_prefill else None,
        ), cp=self.cp.size)

    def enable_migration(self, link: PeerLink, addresses: list[tuple[str, int]],
                         notify: Callable[..., None] = lambda *a: None) -> None:
        """Every rank: take part in moving KV blocks between this instance and others over `link`
        (this rank's endpoint; `addresses` every rank of this instance's, in rank order). The
        driver also gets the migration endpoint the serving layer drives; `notify` reports its events."""
        if self.cp.size > 1:
            raise ContextParallelError("live migration of context-parallel instances is not supported")
        if self.worker is None:
            raise RuntimeError("migration needs a fixed KV cache (num_blocks)")
        cfg = self.cfg
        layout = KVLayout(self.groups.tp.size, self.pp.size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
        self.mover = BlockMover(link, layout, self.groups.world.rank, addresses, self.worker.cache.layers,
                                self.stage.layer_ids)
        if self.is_driver:
            self.migration = MigrationEndpoint(self, notify)

    def queue_transfer(self, op: TransferOp) -> None:
        """Driver: a KV block move every rank makes with the next plan (sent at once if idle)."""
        self._transfers.append(op)

    @property
    def overlap(self) -> str:
        return self.worker_options["overlap"]

    @overlap.setter
    def overlap(self, mode: str) -> None:
        """Switch token-splitting overlap (the overlap report compares the modes on one engine)."""
        self.worker_options["overlap"] = mode
        if self.worker is not None:
            self.worker.overlap = mode

    @property
    def sequence_parallel(self) -> str:
        return self.worker_options["sequence_parallel"]

    @sequence_parallel.setter
    def sequence_parallel(self, mode: str) -> None:
        self.worker_options["sequence_parallel"] = mode
        if self.worker is not None:
            self.worker.sequence_parallel = mode

    @property
    def num_blocks(self) -> int:
        return self.scheduler.config.num_blocks if self.scheduler else 0

    def close(self) -> None:
        """Release the stage group this engine made (pp > 1); the caller owns the others."""
        if self.stage_comm is not self.groups.world:
            self.stage_comm.destroy()


def layered_schedule(schedule: str, layer_groups: Optional[int], stage, groups: ParallelGroups
                     ) -> Optional[LayeredPrefill]:
    """The scheduler's layered-prefill settings for `--prefill-schedule` (None: chunked), or a
    clear error where this engine cannot run it."""
    if schedule not in SCHEDULES:
        raise ValueError(f"prefill schedule {schedule!r} is not one of {SCHEDULES}")
    if schedule == "chunked":
        return None
    why = ("pp > 1 (a prompt's hidden states would cross stages between groups)" if groups.pp.size > 1 else
           "cp > 1 (a context-parallel prompt runs whole, in one step)" if groups.cp.size > 1 else
           "Ladder Residual layers (their residual stream is two tensors wide)" if getattr(stage, "ladder", None)
           and stage.ladder.active else None)
    if why is not None:
        raise ValueError(f"--prefill-schedule layered is not supported with {why}; use chunked")
    return LayeredPrefill(len(stage.layers), layer_groups)

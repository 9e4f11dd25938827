"""The engine: one step loop for serving and for offline generation.

The driver (world rank 0) owns the requests and the scheduler. Every step it builds a plan
(scheduler.py), sends it to the ranks of the first pipeline stage, and runs its own share;
each stage passes the plan on with its hidden states, and the last stage's sampler rank (the
driver's pipeline peer) samples the flagged rows and sends the tokens back. The other ranks
follow the plans and coordinate nothing else.

`Engine` is the composition root (as vLLM's EngineCore holds a scheduler, a KV cache manager and
an executor): it builds one object per job, each with its own state, handed what it uses:

- intake.py `RequestRegistry`: the command queue other threads feed, the live requests by id;
- step_pacing.py `StepPacer`: the ITL target, the step costs learned online, the step times;
- pipeline.py `PipelineTransport`: plans, hidden states and sampled tokens between ranks;
- stage_runner.py `StageRunner`: this rank's share of each plan; the follower loop;
- request_progress.py `RequestProgress`: a sampled token to its request: stops, output deltas;
- driver_step.py `StepDriver`: planning, launching and completing a step;
- offline_generate.py `OfflineGenerator`: `generate`, "submit everything, run the loop", timed;
- structured/compiler.py `GrammarCompiler`: structured outputs' grammars for this model's tokenizer
  (a request's grammar state is made when it is added or adopted, from its output ids).

The KV cache, the worker and the scheduler are made when the cache's size is known (at once,
or per offline batch), and with them the objects that use them; the rest live as long as the
engine. Its methods are the API the serving layer, the bench and the library use.

A request can fail only itself (step_guard.py): an exception in what the driver alone does
(planning, sampling, stop checks) ends the requests concerned with an error and the loop goes on;
one in the forward, which every rank runs, still ends the instance (unless it is the only rank).
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from typing import Any, Callable, Optional

from loguru import logger

from dist_infer.comm.base import Communicator
from dist_infer.comm.groups import ParallelGroups
from dist_infer.comm.peer.link import PeerLink
from dist_infer.engine.decode_graphs import graphs_wanted
from dist_infer.engine.device_io import module_device
from dist_infer.engine.driver_step import StepDriver
from dist_infer.engine.engine_config import EngineConfig, WorkerOptions
from dist_infer.engine.engine_stats import engine_stats
from dist_infer.engine.intake import RequestRegistry, check_servable, new_request, resume
from dist_infer.engine.kv_cache import PagedKVCache
from dist_infer.engine.kv_transfer import BlockMover, KVLayout, TransferOp
from dist_infer.engine.layered_prefill import LayeredPrefill
from dist_infer.engine.malloc_tuning import tune_malloc
from dist_infer.engine.migration import MigrationEndpoint
from dist_infer.engine.offline_generate import OfflineGenerator, Timing, blocks_for_batch
from dist_infer.engine.offline_outputs import GenerationOutput, share_outputs
from dist_infer.engine.pipeline import PipelineTransport
from dist_infer.engine.request import PromptError, Request, RequestOutput, check_prompt
from dist_infer.engine.request_progress import RequestProgress
from dist_infer.engine.sampling import SampledTokens, SamplingParams
from dist_infer.engine.scheduler import Scheduler
from dist_infer.engine.speculative.counters import SpeculativeCounters
from dist_infer.engine.speculative.draft_model import build_drafter
from dist_infer.engine.stage_runner import StageRunner
from dist_infer.engine.step_guard import StepGuard
from dist_infer.engine.step_pacing import StepPacer
from dist_infer.engine.structured.compiler import GrammarCompiler
from dist_infer.engine.structured.counters import StructuredCounters
from dist_infer.engine.structured.mask_filler import MaskFiller
from dist_infer.engine.structured.matcher import GrammarRejected
from dist_infer.engine.structured.spec import StructuredSpecError
from dist_infer.engine.worker import StageWorker
from dist_infer.models.cp_attention import ContextParallelError

__all__ = ["Engine", "EngineConfig", "GenerationOutput", "PromptError", "Timing", "WorkerOptions"]


class Engine:
    """One model instance's step loop. Every rank constructs it; world rank 0 drives."""

    def __init__(
        self,
        stage,
        groups: ParallelGroups,
        config: Optional[EngineConfig] = None,
        *,
        sampler: Optional[Callable[..., SampledTokens]] = None,
        tokenizer: Optional[Callable[[], Any]] = None,
    ):
        """`config`: EngineConfig's defaults when None. `sampler`: logits, rows, EOS ids ->
        SampledTokens on the sampler rank (None: sampling.sample_rows); the seam where a check
        without a device's values puts a fixed token. `tokenizer`: returns the checkpoint's
        TextTokenizer, called once, when the first structured request comes (None: structured
        outputs are refused); every rank gets the same, since every rank checks an offline batch."""
        config = config if config is not None else EngineConfig()
        check_layout(stage, groups)
        tune_malloc()
        self.stage, self.groups, self.config, self.cfg = stage, groups, config, stage.cfg
        self.block_size = config.block_size
        self.pp: Communicator = groups.pp
        self.is_driver = groups.world.rank == 0
        coords = groups.mesh.coords(groups.world.rank)
        self.is_sampler = self.pp.rank == self.pp.size - 1 and all(coords[a] == 0 for a in ("tp", "cp", "ep", "dp"))
        self.stage_comm = stage_group(groups)
        if config.prefix_caching and groups.cp.size > 1 and groups.world.rank == 0:
            logger.info(f"prefix caching is off: not supported with context parallel (cp={groups.cp.size})")
        self.layered = layered_schedule(config.prefill_schedule, config.layer_groups, stage, groups)
        self.sampler = sampler
        self.registry = RequestRegistry()
        self.pacer = StepPacer(config.itl, groups.pp.size)
        self.guard = StepGuard(self._fail)
        self.transport = PipelineTransport(groups.pp, self.stage_comm, self.cfg.vocab_size)
        self.timing = Timing()
        self.structured = StructuredCounters()  # grammars and masks: what they cost, for the metrics
        self.grammars = GrammarCompiler(
            tokenizer, self.cfg.vocab_size, self.cfg.eos_token_ids, counters=self.structured
        )
        self.masks = MaskFiller(counters=self.structured, parallel=module_device(stage).type != "cpu")
        spec = config.speculative
        self.speculative = SpeculativeCounters(spec.num_tokens if spec else 0)  # rounds, proposed, accepted
        self._draft: dict = {}  # the draft model, loaded once (engine/speculative/draft_model.py)
        self.mover: Optional[BlockMover] = None
        self.migration: Optional[MigrationEndpoint] = None
        # made with the KV cache (_allocate): at once for a fixed size, else per offline batch
        self.worker: Optional[StageWorker] = None
        self.scheduler: Optional[Scheduler] = None
        self.progress: Optional[RequestProgress] = None
        self.runner: Optional[StageRunner] = None
        self.step_driver: Optional[StepDriver] = None
        self.offline: Optional[OfflineGenerator] = None
        if config.num_blocks is not None:
            self._allocate(config.num_blocks)

    # -- set-up ---------------------------------------------------------------------------------
    def _allocate(self, num_blocks: int, max_rows: Optional[int] = None) -> None:
        """The KV cache, worker and scheduler for `num_blocks` blocks, and the objects that use
        them; `max_rows`: the most sequences a step will hold (offline: the batch; default
        max_num_seqs), the largest decode bucket. The old cache goes before the new one is made."""
        first_step = self.step_driver.next_step if self.step_driver is not None else 0
        self.worker = self.scheduler = self.progress = self.runner = self.step_driver = self.offline = None
        config, stage, cp, spec = self.config, self.stage, self.groups.cp.size, self.config.speculative
        device = module_device(stage)
        graphs = graphs_wanted(config.worker.cuda_graphs, device)
        cache = PagedKVCache(
            len(stage.layers),
            num_blocks,
            self.block_size,
            max(1, stage.kv_heads_local),
            self.cfg.head_dim,
            stage.dtype,
            device,
            scratch=graphs,
        )
        rows = min(config.max_num_seqs, max_rows or config.max_num_seqs)
        self.worker = StageWorker(stage, self.groups, cache, self.block_size, **asdict(config.worker), max_rows=rows)
        drafter = None
        if spec is not None:
            drafter = build_drafter(
                spec, stage, self.is_driver, self.speculative, num_blocks, self.block_size, self._draft
            )
        scheduling = config.scheduler_config(num_blocks, self.cfg.max_positions, cp, self.layered)
        scheduling = replace(scheduling, cache_generated=not getattr(stage, "prompt_bf16", False))
        self.scheduler = Scheduler(scheduling, cp=cp, drafter=drafter)
        self.progress = RequestProgress(self.scheduler, self.registry, self.cfg.eos_token_ids, self.cfg.max_positions)
        self.runner = StageRunner(
            stage, self.worker, self.transport, self.guard, self.sampler, self.is_sampler, cp, self.mover
        )
        self.step_driver = StepDriver(
            self.scheduler,
            self.worker,
            self.runner,
            self.transport,
            self.registry,
            self.progress,
            self.pacer,
            self.guard,
            model_cfg=self.cfg,
            world_size=self.groups.world.size,
            heartbeat_s=config.heartbeat_s,
            first_step=first_step,
            masks=self.masks,
        )
        self.offline = OfflineGenerator(self.step_driver, self.registry, self.scheduler, self.add_request)

    def _fail(self, r: Request, message: str) -> RequestOutput:
        """The guard's way to end a request with an error (its blocks freed, forgotten)."""
        return self.progress.fail(r, message)

    def enable_migration(
        self, link: PeerLink, addresses: list[tuple[str, int]], notify: Callable[..., None] = lambda *a: None
    ) -> None:
        """Every rank: take part in moving KV blocks between this instance and others over `link`
        (this rank's endpoint; `addresses` every rank of this instance's, in rank order). The
        driver also gets the migration endpoint the serving layer drives; `notify` reports its events."""
        if self.groups.cp.size > 1:
            raise ContextParallelError("live migration of context-parallel instances is not supported")
        if self.worker is None:
            raise RuntimeError("migration needs a fixed KV cache (num_blocks)")
        cfg = self.cfg
        layout = KVLayout(self.groups.tp.size, self.pp.size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
        self.mover = BlockMover(
            link, layout, self.groups.world.rank, addresses, self.worker.cache.layers, self.stage.layer_ids
        )
        self.runner.attach(self.mover)
        if self.is_driver:
            self.migration = MigrationEndpoint(self, notify)

    def close(self) -> None:
        """Release the stage group this engine made (pp > 1; the caller owns the others) and the
        mask filler's thread."""
        self.masks.close()
        if self.stage_comm is not self.groups.world:
            self.stage_comm.destroy()

    # -- settings -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.scheduler.config.num_blocks if self.scheduler else 0

    @property
    def overlap(self) -> str:
        return self.config.worker.overlap

    @overlap.setter
    def overlap(self, mode: str) -> None:
        """Switch token-splitting overlap (the overlap report compares the modes on one engine)."""
        self._set_worker_option(overlap=mode)

    @property
    def sequence_parallel(self) -> str:
        return self.config.worker.sequence_parallel

    @sequence_parallel.setter
    def sequence_parallel(self, mode: str) -> None:
        self._set_worker_option(sequence_parallel=mode)

    def _set_worker_option(self, **option: str) -> None:
        """A worker option from now on: in the config (a later cache's worker) and the worker's."""
        self.config = replace(self.config, worker=replace(self.config.worker, **option))
        if self.worker is not None:
            for name, value in option.items():
                setattr(self.worker, name, value)

    @property
    def return_logits(self) -> bool:
        """The work plans return the logits too (offline generate sets it per batch)."""
        return self.step_driver is not None and self.step_driver.return_logits

    @return_logits.setter
    def return_logits(self, value: bool) -> None:
        self.step_driver.return_logits = value

    # -- requests (driver; thread-safe where said) ----------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, name: str = "prompt") -> None:
        """Raise RequestError naming the field if the engine can never serve this request, or
        StructuredSpecError if its structured-output spec is not one this model can generate."""
        check_servable(prompt_token_ids, params, self.cfg.vocab_size, self.cfg.max_positions, self.scheduler, name)
        if params.structured is not None:
            self.grammars.validate(params.structured)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request (thread-safe); it joins the batch at the next step."""
        self.check_request(prompt_token_ids, params)
        r = new_request(request_id, prompt_token_ids, params)
        self.start_grammar(r)
        return self.registry.submit(r)

    def resume_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, progress, submit: bool = True
    ) -> Request:
        """Queue a request whose instance died (thread-safe): it goes on from the tokens its client
        already has (intake.resume; `progress` a serving/fleet/wire.ResumeProgress). Without
        `submit` it is made, not queued (the caller may take it over from a KV mirror)."""
        self.check_request(prompt_token_ids, params)
        r = resume(new_request(request_id, prompt_token_ids, params), progress, time.monotonic())
        try:
            self.start_grammar(r)
        except GrammarRejected as exc:
            raise StructuredSpecError("structured", f"the output so far does not fit the spec: {exc}") from exc
        return self.registry.submit(r) if submit else r

    def start_grammar(self, request: Request) -> None:
        """Give a structured request its grammar state after the output ids it has (none for a new
        one; a resumed or migrated request's so far). GrammarRejected if they do not fit its spec."""
        if request.params.structured is not None:
            request.grammar = self.grammars.matcher(request.params.structured, request.output_token_ids)

    def abort(self, request_id: str) -> None:
        """End a request wherever it is (thread-safe, idempotent); its blocks are freed."""
        self.registry.abort(request_id)

    def count_rejected(self) -> None:
        """An add that was refused still counts as applied (the API's pending count goes by it)."""
        self.registry.count_added()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the step loop's thread before the next step (thread-safe): how the serving
        layer drives a migration without touching the scheduler from another thread."""
        self.registry.call_soon(fn)

    def wake(self) -> None:
        """Cut an idle driver's wait short (a stop was asked for from another thread)."""
        self.registry.wake()

    def has_unfinished(self) -> bool:
        return self.registry.has_unfinished()

    def stats(self) -> dict:
        return engine_stats(
            self.scheduler,
            self.registry.requests_added,
            self.pacer,
            self.structured.snapshot(),
            self.speculative.snapshot(),
        )

    def prefix_events(self) -> tuple[list[int], list[int]]:
        """Driver: the block hashes the prefix cache stored and evicted since the last call."""
        return self.scheduler.allocator.take_events() if self.scheduler is not None else ([], [])

    # -- migration's view (driver; the step loop's thread) ---------------------------------------
    def find(self, request_id: str) -> Optional[Request]:
        """Driver: the live request with this id, or None."""
        return self.registry.find(request_id)

    def hand_over(self, request: Request) -> None:
        """Driver: a paused request now lives on another instance: free its blocks, forget it here
        (no output: its client streams on from there)."""
        self.scheduler.hand_over(request)
        self.registry.forget(request.request_id)

    def adopt(self, request: Request, blocks: list[int]) -> None:
        """Driver: a request that migrated here, its computed tokens' KV in `blocks` (its grammar
        state made already: start_grammar)."""
        self.registry.register(request)
        self.scheduler.install(request, blocks)

    def queue_transfer(self, op: TransferOp) -> None:
        """Driver: a KV block move every rank makes with the next plan (sent at once if idle)."""
        self.step_driver.queue_transfer(op)

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Driver: launch steps until pp are in flight, complete the oldest; its outputs."""
        return self.step_driver.step()

    def run_driver(
        self,
        publish: Callable[[list[RequestOutput]], None],
        should_stop: Callable[[], bool],
        after_step: Optional[Callable[[], None]] = None,
    ) -> None:
        """Step until `should_stop()`; hand each step's outputs to `publish`, then call
        `after_step`. Sleeps while idle (briefly, while migrating blocks are on the way)."""
        while not should_stop():
            if not self.registry.has_unfinished() and not self.step_driver.in_flight:
                moving = self.migration is not None and self.migration.busy
                self.registry.wait(0.002 if moving else self.config.heartbeat_s / 2)
            # a buddy's long request may fail over here mid-step: a step of prompts alone keeps the ITL target too
            outputs = self.step_driver.step(self.migration is not None and self.migration.failovers_may_arrive)
            if outputs:
                publish(outputs)
            if self.migration is not None:
                # after the publish: a paused request's last token is on its way to the client before
                # the pause is answered, so the destination's first token can never overtake it
                self.migration.poll()
            if after_step is not None:
                after_step()
        self.step_driver.stop_followers()

    def stop_followers(self) -> None:
        """Driver: complete what is in flight and tell every other rank the loop is over."""
        self.step_driver.stop_followers()

    def follow(self) -> None:
        """Every rank but the driver: run the plans as they come, until the driver says stop."""
        self.runner.follow()

    def follow_one(self) -> bool:
        """Every rank but the driver: run the next plan; False once it said stop."""
        return self.runner.follow_one()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams = SamplingParams(), return_logits: bool = False
    ) -> list[GenerationOutput]:
        """Collective: every rank calls it with the same prompts; every rank gets the outputs."""
        prompts = [list(p) for p in prompts]
        self._prepare_batch(prompts, params)
        if self.is_driver:
            outputs, self.timing = self.offline.run(prompts, params, return_logits)
        else:
            # its own prefill time, wall and CPU: up to its first sampled step (a profile splits at it)
            self.timing = Timing.for_batch(prompts)
            self.timing.ttft_s, self.timing.ttft_cpu_s = self.runner.follow(time_prefill=True)
            outputs = None
        return share_outputs(self.groups.world, self.cfg.vocab_size, outputs, prompts, return_logits)

    def _prepare_batch(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Check an offline batch, and (no fixed cache) size the cache for it: only the model's
        limits apply then, as the cache grows to hold the whole batch."""
        if not prompts:
            raise PromptError("no prompts given")
        fixed = self.config.num_blocks is not None
        if params.structured is not None:
            self.grammars.validate(params.structured)  # on every rank, so all refuse it alike
        for i, p in enumerate(prompts):
            if fixed:
                self.check_request(p, params, name=f"prompt {i}")
            else:
                check_prompt(p, params, self.cfg.vocab_size, self.cfg.max_positions, f"prompt {i}")
        if not fixed:
            need = blocks_for_batch(prompts, params.max_new_tokens, self.block_size, self.groups.cp.size)
            if self.scheduler is None or self.num_blocks < need:
                self._allocate(need, max_rows=len(prompts))


def check_layout(stage, groups: ParallelGroups) -> None:
    """Raise ContextParallelError where this layout cannot run context parallel."""
    if groups.cp.size > 1 and groups.pp.size > 1:
        raise ContextParallelError(f"cp with pp is not supported yet (cp={groups.cp.size}, pp={groups.pp.size})")
    if groups.cp.size > 1 and getattr(stage, "cp", None) is None:
        raise ContextParallelError(f"cp={groups.cp.size}: {type(stage).__name__} has no context-parallel attention")


def stage_group(groups: ParallelGroups) -> Communicator:
    """The ranks of this rank's pipeline stage: the driver sends each plan to stage 0's."""
    if groups.pp.size == 1:
        return groups.world
    mesh = groups.mesh
    stages = [[r for r in range(mesh.world_size) if mesh.coords(r)["pp"] == s] for s in range(groups.pp.size)]
    return groups.world.split(stages, "stage")


def layered_schedule(
    schedule: str, layer_groups: Optional[int], stage, groups: ParallelGroups
) -> Optional[LayeredPrefill]:
    """The scheduler's layered-prefill settings for `--prefill-schedule` (None: chunked), or a
    clear error where this engine cannot run it."""
    if schedule == "chunked":
        return None
    why = (
        "pp > 1 (a prompt's hidden states would cross stages between groups)"
        if groups.pp.size > 1
        else "cp > 1 (a context-parallel prompt runs whole, in one step)"
        if groups.cp.size > 1
        else "Ladder Residual layers (their residual stream is two tensors wide)"
        if getattr(stage, "ladder", None) and stage.ladder.active
        else None
    )
    if why is not None:
        raise ValueError(f"--prefill-schedule layered is not supported with {why}; use chunked")
    return LayeredPrefill(len(stage.layers), layer_groups)

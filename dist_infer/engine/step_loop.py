"""The engine: one step loop for serving and for offline generation.

The driver (world rank 0) owns the requests and the scheduler. Every step it builds a plan
(scheduler.py), sends it to the ranks of the first pipeline stage, and runs its own share;
each stage passes the plan on with its hidden states, and the last stage's sampler rank (the
driver's pipeline peer) samples the flagged rows and sends the tokens back. With pipeline
parallelism up to pp steps are in flight at once, each on a different set of requests, so
every stage stays busy. The other ranks follow the plans and coordinate nothing else.

A request can fail only itself (step_guard.py): an exception in what the driver alone does
(planning, sampling, stop checks) ends the requests concerned with an error and the loop goes on;
one in the forward, which every rank runs, still ends the instance (unless it is the only rank).

Offline generation (`generate`) is "submit everything, run the loop": the same engine, with
no token budget and a cache sized for the batch unless told otherwise.
"""

from __future__ import annotations

import queue
import secrets
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from dist_infer.comm.base import Communicator, Handle
from dist_infer.comm.groups import ParallelGroups
from dist_infer.comm.peer_link import PeerLink
from dist_infer.engine.allocator import tune_malloc
from dist_infer.engine.kv_cache import PagedKVCache
from dist_infer.engine.kv_transfer import BlockMover, KVLayout, TransferOp
from dist_infer.engine.migration import MigrationEndpoint
from dist_infer.engine.offline_outputs import GenerationOutput, share_outputs
from dist_infer.engine.request import PromptError, Request, RequestOutput, check_prompt
from dist_infer.engine.sampling import SampledTokens, SamplingParams, batch_seed, sample_rows
from dist_infer.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, blocks_at_full_length
from dist_infer.engine.step_guard import StepGuard, failed_error_id, failed_output
from dist_infer.engine.step_plan import KIND_IDLE, KIND_STOP, KIND_WORK, StepPlan, decode, encode, sizes
from dist_infer.engine.worker import StageWorker
from dist_infer.models.cp_attention import CP_VARIANTS, ContextParallelError
from dist_infer.parallel.sequence_parallel import should_sequence_parallel
from dist_infer.parallel.token_split import should_split

TAG_FORWARD, TAG_BACK = 1, 2
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



@dataclass
class Timing:
    ttft_s: float = 0.0
    prefill_tokens: int = 0
    sequences: int = 1
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttft_cpu_s: float = 0.0  # CPU time of this process (all its threads) for the prefill: load-independent cost
    steps: int = 0
    preemptions: int = 0
    token_gaps_s: list = field(default_factory=list)  # each sequence's time between successive tokens

    def as_dict(self) -> dict:
        return {
            "ttft_s": self.ttft_s,
            "prefill_tok_s": self.prefill_tokens / self.ttft_s if self.ttft_s else 0.0,
            "decode_tok_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
            # time per output token of one sequence, i.e. per decode step of the batch (the peers' definition)
            "tpot_s": self.decode_s * self.sequences / self.decode_tokens if self.decode_tokens else 0.0,
            # the median gap between a sequence's tokens (vLLM's median ITL): a typical decode step,
            # which one stalled step (a page fault, another process taking the core) does not move
            "tpot_median_s": statistics.median(self.token_gaps_s) if self.token_gaps_s else 0.0,
            "ttft_cpu_s": self.ttft_cpu_s,
            "steps": self.steps,
            "preemptions": self.preemptions,
        }


@dataclass
class _InFlight:
    plan: StepPlan
    chunks: list  # the scheduler's chunks, in plan order
    launched: float
    result: Optional[SampledTokens] = None  # pp=1: sampled at launch; pp>1: comes back from the last stage


class Engine:
    """One model instance's step loop. Every rank constructs it; world rank 0 drives."""

    def __init__(self, stage, groups: ParallelGroups, block_size: int = 16,
                 overlap: str = "off", overlap_threshold: Optional[int] = DEFAULT_OVERLAP_THRESHOLD,
                 cp_variant: str = "auto",
                 sequence_parallel: str = "off",
                 sequence_parallel_threshold: Optional[int] = DEFAULT_SEQUENCE_PARALLEL_THRESHOLD,
                 num_blocks: Optional[int] = None, max_batched_tokens: Optional[int] = None,
                 max_num_seqs: int = 256, chunked_prefill: bool = True, watermark: float = 0.01,
                 static_batching: bool = False, decode_stall_limit: Optional[float] = None,
                 tokenizer=None, heartbeat_s: float = HEARTBEAT_S):
        """num_blocks None: sized for each `generate` batch (offline). max_batched_tokens None: no budget.
        decode_stall_limit F: beside running decodes, prompt chunks are cut so a step takes about F
        times a decode-only step (from measured step times; pp=1); None: only the budget cuts them."""
        if decode_stall_limit is not None and decode_stall_limit <= 1:
            raise ValueError(f"decode_stall_limit must be above 1 (a multiple of a decode step), got {decode_stall_limit}")
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
        self.worker_options = dict(overlap=overlap, overlap_threshold=overlap_threshold,
                                   sequence_parallel=sequence_parallel,
                                   sequence_parallel_threshold=sequence_parallel_threshold, cp_variant=cp_variant)
        self.fixed_blocks = num_blocks
        self.max_batched_tokens, self.max_num_seqs = max_batched_tokens, max_num_seqs
        self.chunked_prefill, self.watermark, self.static_batching = chunked_prefill, watermark, static_batching
        self.tokenizer = tokenizer
        self.heartbeat_s = heartbeat_s
        self.decode_stall_limit = decode_stall_limit
        self._decode_step_s: Optional[float] = None  # moving averages of measured step times
        self._prefill_token_s: Optional[float] = None
        self.timing = Timing()
        self.worker: Optional[StageWorker] = None
        self.scheduler: Optional[Scheduler] = None
        self._pending: list[Handle] = []
        self._inflight: deque[_InFlight] = deque()
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

    def _allocate(self, num_blocks: int) -> None:
        budget = self.max_batched_tokens
        if not self.chunked_prefill and budget is not None and budget < self.cfg.max_positions:
            budget = self.cfg.max_positions  # unchunked, any prompt must fit in one step (vLLM's rule too)
        kv_heads = max(1, self.stage.kv_heads_local)
        device = next(self.stage.parameters()).device
        cache = PagedKVCache(len(self.stage.layers), num_blocks, self.block_size, kv_heads, self.cfg.head_dim,
                             self.stage.dtype, device)
        self.worker = StageWorker(self.stage, self.groups, cache, self.block_size, **self.worker_options)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=self.block_size, max_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs, watermark=self.watermark,
            chunked_prefill=self.chunked_prefill and self.cp.size == 1, whole_prompt_steps=self.cp.size > 1,
            static_batching=self.static_batching,
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

    def find(self, request_id: str) -> Optional[Request]:
        """Driver: the live request with this id, or None."""
        return self._requests.get(request_id)

    def hand_over(self, request: Request) -> None:
        """Driver: a paused request now lives on another instance: free its blocks, forget it here
        (no output: its client streams on from there)."""
        self.scheduler.hand_over(request)
        self._requests.pop(request.request_id, None)

    def adopt(self, request: Request, blocks: list[int]) -> None:
        """Driver: a request that migrated here, its computed tokens' KV in `blocks`."""
        request.seq_id = self._next_seq
        self._next_seq += 1
        self._requests[request.request_id] = request
        self.scheduler.install(request, blocks)

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

    def blocks_for_batch(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """KV blocks that hold every sequence of an offline batch at full length at once (the bound
        check_fits holds a request to, so a batch sized here always passes it)."""
        return max(1, sum(blocks_at_full_length(len(p), max_new_tokens, self.block_size, self.cp.size) for p in prompts))

    # -- requests (driver; callable from other threads) -------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, name: str = "prompt") -> None:
        """Raise RequestError naming the field if the engine can never serve this request."""
        check_prompt(prompt_token_ids, params, self.cfg.vocab_size, self.cfg.max_positions, name)
        if self.scheduler is not None:
            why = self.scheduler.check_fits(len(prompt_token_ids), params.max_new_tokens)
            if why:
                raise PromptError(f"{name}: {why}", field="max_tokens")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request (thread-safe); it joins the batch at the next step."""
        return self._enqueue(self._new_request(request_id, prompt_token_ids, params))

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        self.check_request(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else secrets.randbits(52)
        return Request(request_id, list(prompt_token_ids), params, seed)

    def _enqueue(self, request: Request) -> Request:
        self._commands.put(("add", request))
        self._wakeup.set()
        return request

    def resume_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       progress: dict) -> Request:
        """Queue a request whose instance died (thread-safe): it goes on from the tokens its client
        already has, prefilled again with them, and reports only what is new. `progress`:
        token_ids, logprobs, top_logprobs, text_chars (reported so far), age_s, first_token_age_s.
        With the same seed (sampling draws from (seed, position)) it continues exactly as it would have."""
        r = self._new_request(request_id, prompt_token_ids, params)
        tokens = list(progress["token_ids"])
        r.output_token_ids, r.output_logprobs = tokens, list(progress["logprobs"])
        r.output_top_logprobs = [[tuple(x) for x in row] for row in progress["top_logprobs"]]
        if self.tokenizer is not None and tokens:
            r.text = self.tokenizer.decode(tokens)
            if 1 < params.min_tokens <= len(tokens) + 1:
                r.stop_search_from = len(self.tokenizer.decode(tokens[:params.min_tokens - 1]))
        r.emitted_tokens, r.emitted_text = len(tokens), int(progress["text_chars"])
        now = time.monotonic()
        r.arrival_time = now - progress["age_s"]
        if tokens and progress.get("first_token_age_s") is not None:
            r.first_token_time = now - progress["first_token_age_s"]
        return self._enqueue(r)

    def abort(self, request_id: str) -> None:
        """End a request wherever it is (thread-safe, idempotent); its blocks are freed."""
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def count_rejected(self) -> None:
        """An add that was refused still counts as applied (the API's pending count goes by it)."""
        self.requests_added += 1

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the step loop's thread before the next step (thread-safe): how the serving
        layer drives a migration without touching the scheduler from another thread."""
        self._commands.put(("call", fn))
        self._wakeup.set()

    def wake(self) -> None:
        """Cut an idle driver's wait short (a stop was asked for from another thread)."""
        self._wakeup.set()

    def has_unfinished(self) -> bool:
        return bool(self._requests) or not self._commands.empty()

    def stats(self) -> dict:
        s = self.scheduler
        if s is None:
            return {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0,
                    "num_preemptions_total": 0, "free_blocks": 0, "total_blocks": 0}
        return {"num_requests_running": len(s.running), "num_requests_waiting": len(s.waiting),
                "kv_cache_usage_perc": s.usage, "num_preemptions_total": s.num_preemptions,
                "free_blocks": s.num_free_blocks, "total_blocks": s.config.num_blocks,
                "watermark_blocks": s.watermark_blocks, "waiting_demand_blocks": s.waiting_demand(),
                "growth_blocks": s.growth_demand(),
                "running_ids": [r.request_id for r in s.running], "waiting_ids": [r.request_id for r in s.waiting],
                "running_blocks": [len(r.block_table) for r in s.running], "requests_added": self.requests_added}

    def _apply_commands(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return outputs
            if command == "add":
                self.requests_added += 1
                arg.seq_id = self._next_seq
                self._next_seq += 1
                self._requests[arg.request_id] = arg
                self.scheduler.add(arg)
            elif command == "call":
                arg()
            elif command == "abort":
                request = self._requests.get(arg)
                if request is not None:
                    request.finish_reason = "abort"
                    outputs.append(self._finish(request, "abort"))

    # -- the driver's step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch steps until pp are in flight (or nothing is schedulable), then complete the
        oldest. Returns what the completed step added to each request."""
        outputs = self._apply_commands()
        while len(self._inflight) < self.pp.size:
            scheduled = self.scheduler.schedule(self._seqs_per_step(), self._prefill_cap())
            self._freed += [r.seq_id for r in scheduled.freed]
            if not scheduled.chunks:
                break
            before = len(self._inflight)
            outputs += self._launch(scheduled)
            if len(self._inflight) == before:
                break  # the step failed before it ran (its requests with it): the next one goes on
        if self._transfers:  # nothing to run this step, but blocks to move: an idle plan carries them
            self._send_plan(StepPlan(kind=KIND_IDLE, step=self._step, freed=self._take_freed(),
                                     transfers=self._take_transfers()))
        if self._inflight:
            outputs += self._complete(self._inflight.popleft())
        elif time.monotonic() - self._last_plan > self.heartbeat_s:
            self._send_plan(StepPlan(kind=KIND_IDLE, step=self._step, freed=self._take_freed()))
        return outputs

    def _seqs_per_step(self) -> Optional[int]:
        """With pp stages, each step takes about 1/pp of the live requests, so pp steps on
        different requests chase each other through the stages (prefill and decode alike)."""
        if self.pp.size == 1:
            return None
        live = len(self.scheduler.running) + len(self.scheduler.waiting)
        return max(1, -(-live // self.pp.size))

    def _prefill_cap(self) -> Optional[int]:
        """Prompt tokens to put beside this step's decodes so the step lasts about
        decode_stall_limit decode steps (Sarathi-Serve's budget from the inter-token latency
        target, but measured here instead of profiled beforehand)."""
        if self.decode_stall_limit is None or self._decode_step_s is None or not self._prefill_token_s:
            return None
        return max(16, int((self.decode_stall_limit - 1) * self._decode_step_s / self._prefill_token_s))

    def _learn_step_time(self, flight: "_InFlight", elapsed: float) -> None:
        prefill = sum(c.num_tokens for c in flight.chunks if c.num_tokens > 1)
        decodes = sum(1 for c in flight.chunks if c.num_tokens == 1)

        def ema(old: Optional[float], new: float) -> float:
            return new if old is None else 0.8 * old + 0.2 * new

        if prefill == 0 and decodes:
            self._decode_step_s = ema(self._decode_step_s, elapsed)
        elif prefill >= 8 and (decodes == 0 or self._decode_step_s is not None):
            base = self._decode_step_s if decodes else 0.0
            self._prefill_token_s = ema(self._prefill_token_s, max(elapsed - base, 0.0) / prefill)

    def _take_freed(self) -> list[int]:
        freed, self._freed = self._freed, []
        return freed

    def _take_transfers(self) -> list[TransferOp]:
        transfers, self._transfers = self._transfers, []
        return transfers

    def _launch(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        """Plan the step and send it. A request whose chunk cannot be planned fails alone; a plan
        the metadata check rejects, or (one rank) a forward that raises, fails the step's
        requests. Returns the failed requests' outputs."""
        plan = StepPlan(kind=KIND_WORK, step=self._step, return_logits=self.return_logits)
        chunks, failed = self.guard.plan_chunks(plan, scheduled.chunks, self.cfg, self.num_blocks, self.block_size,
                                                self.cp.size)
        if not chunks:
            return failed
        requests = [c.request for c in chunks]
        try:
            meta = self.worker.prepare(plan)  # before the plan leaves: a bad plan stops here, on the driver
        except Exception as exc:  # noqa: BLE001
            return failed + self.guard.fail_all(requests, "checking its step", exc)
        plan.freed, plan.transfers = self._take_freed(), self._take_transfers()
        self._step += 1
        launched = time.perf_counter()
        try:
            result = self._send_plan(plan, meta)
        except Exception as exc:  # noqa: BLE001
            self.guard.forward_failed(exc, self.groups.world.size)  # re-raises unless this is the only rank
            return failed + self.guard.fail_all(requests, "its step's forward", exc)
        self.guard.forward_ok()
        self._inflight.append(_InFlight(plan, chunks, launched, result))
        return failed

    def _send_plan(self, plan: StepPlan, meta: Optional[object] = None) -> Optional[SampledTokens]:
        """Driver: the plan to every rank of stage 0 (one broadcast of its sizes, two of its
        payload), then this rank's own share of it."""
        ints, floats = encode(plan)
        wire = [sizes(ints, floats), ints, floats]
        comm = self.stage_comm
        if comm.size > 1:
            for t in wire:
                if t.numel():
                    comm.broadcast(t, 0)
        self._last_plan = time.monotonic()
        return self._run_stage(plan, wire, meta=meta)

    def _run_stage(self, plan: StepPlan, wire: list[torch.Tensor], hidden: Optional[torch.Tensor] = None,
                   meta: Optional[object] = None) -> Optional[SampledTokens]:
        """This rank's share of a plan as it arrived (`wire`: its encoded tensors, passed on
        unchanged): forget freed sequences, run the stage on a work step, pass it on, or sample
        (the sampler rank)."""
        self.worker.forget(plan.freed)
        if self.mover is not None:
            for op in plan.transfers:  # before the forward: a commit's blocks are in before they are read
                self.mover.apply(op)
            self.mover.poll()
        last_stage = self.pp.rank == self.pp.size - 1
        if plan.kind != KIND_WORK:
            if not last_stage:
                self._post(wire, self.pp.rank + 1, TAG_FORWARD)
            return None
        inputs = hidden if hidden is not None else torch.tensor(plan.input_ids, dtype=torch.long)
        out = self.worker.execute(plan, inputs, meta)
        if self._follower_start is not None and any(plan.sample):  # this rank's own prefill ends here
            wall, cpu = self._follower_start
            self.timing.ttft_s, self.timing.ttft_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
            self._follower_start = None
        if not last_stage:
            self._post(wire + [out], self.pp.rank + 1, TAG_FORWARD)
            return None
        if not self.is_sampler:
            return None
        logits = out[torch.tensor(plan.sample_index, dtype=torch.long)]
        sampled = self.guard.sample(sample_rows, logits, plan, tuple(self.cfg.eos_token_ids))
        if plan.return_logits:
            sampled.logits = logits.float()
        if self.pp.size > 1:
            k = plan.top_logprobs
            ints = torch.cat([sampled.tokens, sampled.top_ids.reshape(-1)]) if k else sampled.tokens
            floats = torch.cat([sampled.logprobs, sampled.top_logprobs.reshape(-1)]) if k else sampled.logprobs
            msg = [ints.contiguous(), floats.contiguous()] + ([sampled.logits.contiguous()] if plan.return_logits else [])
            self._post(msg, 0, TAG_BACK)
        return sampled

    def _receive_sampled(self, plan: StepPlan) -> SampledTokens:
        """Driver, pp > 1: the last stage's tokens for `plan`."""
        n, k, last = len(plan.rows), plan.top_logprobs, self.pp.size - 1
        ints = torch.empty(n * (1 + k), dtype=torch.long)
        floats = torch.empty(n * (1 + k), dtype=torch.float64)
        self.pp.recv(ints, last, TAG_BACK)
        self.pp.recv(floats, last, TAG_BACK)
        sampled = SampledTokens(ints[:n], floats[:n], ints[n:].view(n, k), floats[n:].view(n, k))
        if plan.return_logits:
            sampled.logits = torch.empty(n, self.cfg.vocab_size, dtype=torch.float32)
            self.pp.recv(sampled.logits, last, TAG_BACK)
        return sampled

    def _post(self, tensors: list[torch.Tensor], dst: int, tag: int) -> None:
        for t in tensors:
            self._pending.append(self.pp.isend(t.contiguous(), dst, tag))
        self._pending = [h for h in self._pending if not h.is_completed()]

    def _drain(self) -> None:
        for h in self._pending:
            h.wait()
        self._pending = []

    # -- results --------------------------------------------------------------------------------
    def _complete(self, flight: _InFlight) -> list[RequestOutput]:
        sampled = flight.result if flight.result is not None else self._receive_sampled(flight.plan)
        if self.pp.size == 1:
            self._learn_step_time(flight, time.perf_counter() - flight.launched)
        now = time.monotonic()
        outputs = []
        rows = [c for c in flight.chunks if c.sample]
        for i, chunk in enumerate(rows):
            r = chunk.request
            if r.finished or not r.in_flight:
                continue  # aborted (or preempted and requeued) while the step was on its way
            error_id = failed_error_id(int(sampled.tokens[i]))  # logged on the sampler rank
            if error_id is not None:
                outputs.append(self.guard.fail(r, "sampling", error_id))
                continue
            try:
                outputs.append(self._take_token(r, sampled, i, flight.plan.return_logits, now))
            except Exception as exc:  # noqa: BLE001 - stop checks, detokenizing: this request's own
                outputs += self.guard.fail_all([r], "taking its token", exc)
        self.timing.steps += 1
        return outputs

    def _take_token(self, r: Request, sampled: SampledTokens, i: int, return_logits: bool, now: float) -> RequestOutput:
        """Row `i` of a step's tokens to its request: append it, check the stops, report."""
        self.scheduler.on_sampled(r)
        token = int(sampled.tokens[i])
        r.output_token_ids.append(token)
        r.output_logprobs.append(float(sampled.logprobs[i]))
        if r.params.logprobs:
            k = r.params.logprobs
            r.output_top_logprobs.append(list(zip(sampled.top_ids[i, :k].tolist(), sampled.top_logprobs[i, :k].tolist())))
        if return_logits:
            r.logits.append(sampled.logits[i].clone())
        if r.first_token_time is None:
            r.first_token_time = now
        reason = self._stop_reason(r)
        return self._finish(r, reason) if reason is not None else self._delta(r)

    def _stop_reason(self, r: Request) -> Optional[str]:
        """Why `r` ends after its newest token, or None. Stop strings are looked for only in text
        that is new since the last token (plus the length of a stop string, for one that spans
        tokens), and only from min_tokens on; EOS cannot come before min_tokens (the sampler bans it)."""
        p, token, n = r.params, r.output_token_ids[-1], len(r.output_token_ids)
        before = len(r.text)
        if self.tokenizer is not None:
            r.text = self.tokenizer.decode(r.output_token_ids)
        if n >= p.min_tokens:
            if p.stop_at_eos and token in self.cfg.eos_token_ids:
                return "stop"
            if token in p.stop_token_set:
                r.stop_reason = token
                return "stop"
            if p.stop and self.tokenizer is not None:
                longest = max(len(s) for s in p.stop)
                start = max(0, before - longest + 1, r.stop_search_from)
                hits = [(r.text.find(s, start), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    at, s = min(hits)
                    r.text, r.stop_reason = r.text[:at], s
                    return "stop"
        elif n == p.min_tokens - 1:
            r.stop_search_from = len(r.text)  # text before min_tokens can never hold the stop
        if n >= p.max_new_tokens or r.num_tokens >= self.cfg.max_positions:
            return "length"
        return None

    def _delta(self, r: Request) -> RequestOutput:
        """New tokens and text since the last report. Text that could be the start of a stop
        string, or an incomplete character, is held back until it is certain."""
        text_end = len(r.text)
        if not r.finished:
            if r.params.stop:
                text_end = max(r.emitted_text, text_end - (max(len(s) for s in r.params.stop) - 1))
            while text_end > r.emitted_text and r.text[text_end - 1] == "\ufffd":
                text_end -= 1
        k = r.emitted_tokens
        out = RequestOutput(
            request_id=r.request_id, new_token_ids=r.output_token_ids[k:], new_logprobs=r.output_logprobs[k:],
            new_top_logprobs=r.output_top_logprobs[k:] if r.params.logprobs else [],
            text_delta=r.text[r.emitted_text:text_end], finished=r.finished, finish_reason=r.finish_reason,
            stop_reason=r.stop_reason, num_prompt_tokens=len(r.prompt_token_ids),
            num_generated_tokens=len(r.output_token_ids))
        r.emitted_tokens, r.emitted_text = len(r.output_token_ids), text_end
        return out

    def _finish(self, r: Request, reason: str) -> RequestOutput:
        self.scheduler.finish(r, reason)
        self._requests.pop(r.request_id, None)
        return self._delta(r)

    def _fail(self, r: Request, message: str) -> RequestOutput:
        """End a request with an error (an abort): its blocks are freed, and the next plan tells
        the followers, as for a client's abort."""
        r.finish_reason = "abort"
        self.scheduler.finish(r, "abort")
        self._requests.pop(r.request_id, None)
        return failed_output(r, message)

    # -- followers ------------------------------------------------------------------------------
    def _receive_plan(self) -> tuple[StepPlan, list[torch.Tensor], Optional[torch.Tensor]]:
        """Follower: the next plan (from the driver's broadcast on stage 0, from the previous
        stage after it), its encoded tensors, and the hidden states of a work step (stage > 0)."""
        if self.pp.rank == 0:
            receive = lambda t: self.stage_comm.broadcast(t, 0)  # noqa: E731
        else:
            receive = lambda t: self.pp.recv(t, self.pp.rank - 1, TAG_FORWARD)  # noqa: E731
        n = torch.empty(2, dtype=torch.long)
        receive(n)
        ints, floats = torch.empty(int(n[0]), dtype=torch.long), torch.empty(int(n[1]), dtype=torch.float64)
        for t in (ints, floats):
            if t.numel() or self.pp.rank > 0:  # the broadcast skips empty payloads; sends carry them
                receive(t)
        plan = decode(ints, floats)
        hidden = None
        if plan.kind == KIND_WORK and self.pp.rank > 0:
            hidden = torch.empty(plan.total_tokens, self.cfg.hidden_size, dtype=self.stage.dtype)
            receive(hidden)
        return plan, [n, ints, floats], hidden

    def follow(self) -> None:
        """Every rank but the driver: run the plans as they come, until the driver says stop."""
        while True:
            plan, wire, hidden = self._receive_plan()
            self._run_stage(plan, wire, hidden)
            if plan.kind == KIND_STOP:
                self._drain()
                return

    def close(self) -> None:
        """Release the stage group this engine made (pp > 1); the caller owns the others."""
        if self.stage_comm is not self.groups.world:
            self.stage_comm.destroy()

    def stop_followers(self) -> None:
        """Driver: tell every other rank the loop is over."""
        while self._inflight:
            self._complete(self._inflight.popleft())
        self._send_plan(StepPlan(kind=KIND_STOP, step=self._step, freed=self._take_freed(),
                                 transfers=self._take_transfers()))
        self._drain()

    # -- serving: the driver's loop -----------------------------------------------------------------
    def run_driver(self, publish: Callable[[list[RequestOutput]], None], should_stop: Callable[[], bool],
                   after_step: Optional[Callable[[], None]] = None) -> None:
        """Step until `should_stop()`; hand each step's outputs to `publish`, then call
        `after_step`. Sleeps while idle (briefly, while migrating blocks are on the way)."""
        while not should_stop():
            if not self._requests and not self._inflight and self._commands.empty():
                moving = self.migration is not None and self.migration.busy
                self._wakeup.wait(0.002 if moving else self.heartbeat_s / 2)
                self._wakeup.clear()
            outputs = self.step()
            if outputs:
                publish(outputs)
            if self.migration is not None:
                # after the publish: a paused request's last token is on its way to the client before
                # the pause is answered, so the destination's first token can never overtake it
                self.migration.poll()
            if after_step is not None:
                after_step()
        self.stop_followers()

    # -- offline ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams(),
                 return_logits: bool = False) -> list[GenerationOutput]:
        """Collective: every rank calls it with the same prompts; every rank gets the outputs."""
        prompts = [list(p) for p in prompts]
        if not prompts:
            raise PromptError("no prompts given")
        for i, p in enumerate(prompts):
            if self.fixed_blocks is None:  # the cache is sized for this batch below: only the model's limits apply
                check_prompt(p, params, self.cfg.vocab_size, self.cfg.max_positions, f"prompt {i}")
            else:
                self.check_request(p, params, name=f"prompt {i}")
        if self.fixed_blocks is None:
            need = self.blocks_for_batch(prompts, params.max_new_tokens)
            if self.scheduler is None or self.num_blocks < need:
                self.worker = self.scheduler = None  # the old cache goes before the new one is made
                self._allocate(need)
        self.timing = Timing(prefill_tokens=sum(len(p) for p in prompts), sequences=len(prompts))
        if not self.is_driver:
            # its own prefill time, wall and CPU: up to its first sampled step (a profile splits at it)
            self._follower_start = (time.perf_counter(), time.process_time())
            self.follow()
            return share_outputs(self.groups.world, self.cfg.vocab_size, None, prompts, return_logits)
        self.return_logits = return_logits
        preempted_before = self.scheduler.num_preemptions
        requests = [self.add_request(f"offline-{self._step}-{i}", p, replace(params, seed=batch_seed(params.seed, i)))
                    for i, p in enumerate(prompts)]
        start, cpu_start = time.perf_counter(), time.process_time()
        first_done = None
        seen = [(0, 0.0)] * len(requests)  # each request's token count and the time its newest arrived
        while self.has_unfinished():
            self.step()
            now = time.perf_counter()
            for i, r in enumerate(requests):
                count, since = seen[i]
                if len(r.output_token_ids) > count:
                    if count:
                        self.timing.token_gaps_s.append((now - since) / (len(r.output_token_ids) - count))
                    seen[i] = (len(r.output_token_ids), now)
            if first_done is None and all(r.output_token_ids or r.finished for r in requests):
                first_done = time.perf_counter()
                self.timing.ttft_s = first_done - start
                self.timing.ttft_cpu_s = time.process_time() - cpu_start
        end = time.perf_counter()
        self.stop_followers()
        self.return_logits = False
        self.timing.decode_tokens = sum(max(0, len(r.output_token_ids) - 1) for r in requests)
        self.timing.decode_s = end - (first_done or end)
        self.timing.preemptions = self.scheduler.num_preemptions - preempted_before
        outputs = [GenerationOutput(r.prompt_token_ids, r.output_token_ids, r.output_logprobs,
                                    r.finish_reason, r.logits, r.num_preemptions) for r in requests]
        return share_outputs(self.groups.world, self.cfg.vocab_size, outputs, prompts, return_logits)

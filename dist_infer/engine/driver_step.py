"""The driver's step: plan a step, launch it, complete the oldest in flight; the serving loop.

With pipeline parallelism up to pp steps are in flight at once, each on about 1/pp of the live
requests, so every stage stays busy. Completing a step hands each sampled row to its request
(request_progress.py); a request that fails in its step fails alone (step_guard.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from dist_infer.engine.kv_transfer import TransferOp
from dist_infer.engine.request import RequestOutput
from dist_infer.engine.sampling import SampledTokens
from dist_infer.engine.scheduler import SchedulerOutput
from dist_infer.engine.step_cost import AUTO_FLOOR_S, StepShape, chunk_pairs
from dist_infer.engine.step_guard import failed_error_id
from dist_infer.engine.step_plan import KIND_IDLE, KIND_WORK, StepPlan


@dataclass
class InFlightStep:
    """A launched step the driver has not completed yet (up to pp of them at once)."""

    plan: StepPlan
    chunks: list  # the scheduler's chunks, in plan order
    launched: float
    result: Optional[SampledTokens] = None  # pp=1: sampled at launch; pp>1: comes back from the last stage


def step_shape(chunks) -> StepShape:
    """A step's shape for the cost model: its prompt chunks, and its decodes (one token each: a
    prompt's last token costs what a decode does)."""
    prompts = [c for c in chunks if c.num_tokens > 1]
    decodes = [c for c in chunks if c.num_tokens == 1]
    # a layered prompt's group runs a fraction of the layers: it costs that fraction of its tokens
    share = [1.0 if c.work_tokens is None else c.work_tokens / c.num_tokens for c in prompts]
    return StepShape(prompt_tokens=round(sum(c.num_tokens * f for c, f in zip(prompts, share))),
                     prompt_pairs=round(sum(chunk_pairs(c.start, c.num_tokens) * f for c, f in zip(prompts, share))),
                     decodes=len(decodes), decode_context=sum(c.start + 1 for c in decodes))


class DriverStep:
    """Engine mixin, driver only: the step and the loop that repeats it. Uses the engine's
    scheduler, worker, guard, `_inflight`, `_freed`, `_transfers` and the pipeline transport."""

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

    def _prefill_cap(self):
        """The step's prompt tokens beside its decodes, sized so the step ends within the
        inter-token latency target (Sarathi-Serve's stall-free budget, from the step costs learned
        online: step_cost.py). None: only the token budget cuts prompts."""
        if self.itl_target is None:
            return None
        return self._prompt_tokens_within

    def _prompt_tokens_within(self, decodes: int, decode_context: int, start: int):
        """Prompt tokens a step of these decodes can add and still meet the target (None: not learned yet)."""
        return self.step_costs.prompt_tokens_within(self.step_target_s(decodes, decode_context), decodes,
                                                    decode_context, start)

    def step_target_s(self, decodes: int, decode_context: int) -> float:
        """One step's share of the inter-token latency target: a fixed time (milliseconds, split
        over the pp steps a request's token waits for), a multiple of the decode-only step, or
        (auto) that multiple but at least AUTO_FLOOR_S over the pp steps."""
        kind, value = self.itl_target
        if kind == "ms":
            return value / 1000.0 / self.pp.size
        target = value * self.step_costs.decode_step_s(decodes, decode_context)
        return max(target, AUTO_FLOOR_S / self.pp.size) if kind == "auto" else target

    def _learn_step_time(self, flight: InFlightStep, now: float) -> None:
        """Feed the step's duration to the cost model and the step-time histogram. With pp steps
        in flight a step's own time is the gap since the previous completion (its slot in the
        pipeline) or, when it ran alone, its latency over the pp stages."""
        shape = step_shape(flight.chunks)
        if flight.launched >= self._last_complete or self.pp.size == 1:
            seconds = (now - flight.launched) / self.pp.size
        else:
            seconds = now - self._last_complete
        self._last_complete = now
        if shape.prompt_tokens or shape.decodes:
            self.step_costs.observe(shape, seconds)
            self.step_times.observe(shape.kind, seconds)

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
        self._inflight.append(InFlightStep(plan, chunks, launched, result))
        return failed


    def _complete(self, flight: InFlightStep) -> list[RequestOutput]:
        sampled = flight.result if flight.result is not None else self._receive_sampled(flight.plan)
        self._learn_step_time(flight, time.perf_counter())
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

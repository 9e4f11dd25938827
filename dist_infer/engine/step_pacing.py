"""Step pacing, on the driver: how long a step may take, and what the steps run so far cost.

The inter-token latency target (Sarathi-Serve's stall-free budget) caps a step's prompt tokens
beside its decodes so the step ends within the target; the caps come from step costs learned
online (step_cost.py), fed here with each completed step's duration. The same costs predict the
prefill backlog the autoscaler reads from the stats. One object holds the target, the cost model
and the step-time histogram, so the driver, the stats and the tests share one account of them.
"""

from __future__ import annotations

from typing import Optional

from dist_infer.engine.step_cost import (
    AUTO_FLOOR_S,
    StepCostModel,
    StepShape,
    StepTimes,
    chunk_pairs,
    prefill_backlog_s,
)


def step_shape(chunks) -> StepShape:
    """A step's shape for the cost model: its prompt chunks, and its decodes (one token each: a
    prompt's last token costs what a decode does) with the proposals they verify."""
    prompts = [c for c in chunks if c.num_tokens > 1 and not c.draft]
    decodes = [c for c in chunks if c.num_tokens == 1 or c.draft]
    # a layered prompt's group runs a fraction of the layers: it costs that fraction of its tokens
    share = [1.0 if c.work_tokens is None else c.work_tokens / c.num_tokens for c in prompts]
    return StepShape(
        prompt_tokens=round(sum(c.num_tokens * f for c, f in zip(prompts, share))),
        prompt_pairs=round(sum(chunk_pairs(c.start, c.num_tokens) * f for c, f in zip(prompts, share))),
        decodes=len(decodes),
        decode_context=sum(c.start + 1 for c in decodes),
        draft_tokens=sum(len(c.draft) for c in decodes),
    )


# how far past the target a step may run to finish a prompt rather than leave its tail to the next step
# (docs/benchmarks.md, "Against vLLM's CPU backend": TTFT and ITL side by side)
FINISH_OVERRUN = 0.3


class StepPacer:
    """The ITL target (arg_types.parse_itl_target's tuple, None: off) of an instance of `pp_size`
    pipeline stages, the step costs learned from its steps, and their durations by kind (/metrics)."""

    def __init__(
        self, itl_target: Optional[tuple[str, float]], pp_size: int, step_costs: Optional[StepCostModel] = None
    ):
        self.itl_target = itl_target
        self.pp_size = pp_size
        self.step_costs = step_costs if step_costs is not None else StepCostModel()
        self.step_times = StepTimes()
        self._last_complete = 0.0

    def prefill_cap(self):
        """The scheduler's cap on a step's prompt tokens beside its decodes, sized so the step ends
        within the target; None: only the token budget cuts prompts."""
        if self.itl_target is None:
            return None
        return self.prompt_tokens_within

    def prompt_tokens_within(
        self, decodes: int, decode_context: int, start: int, draft_tokens: int = 0, left: int = 0
    ) -> Optional[int]:
        """Prompt tokens a step of these decodes (and the proposals they verify) can add and still
        meet the target (None: not learned yet); all `left` tokens of the prompt where they fit
        within FINISH_OVERRUN more: a prompt cut short of its end by a few tokens would wait a whole
        step more for its first token, the decodes paid again, for a target it nearly met."""
        target = self.step_target_s(decodes, decode_context)
        cap = self.step_costs.prompt_tokens_within(target, decodes, decode_context, start, draft_tokens)
        if cap is None or left <= cap:
            return cap
        whole = self.step_costs.prompt_tokens_within(
            target * (1 + FINISH_OVERRUN), decodes, decode_context, start, draft_tokens
        )
        return left if whole is not None and left <= whole else cap

    def step_target_s(self, decodes: int, decode_context: int) -> float:
        """One step's share of the inter-token latency target: a fixed time (milliseconds, split
        over the pp steps a request's token waits for), a multiple of the decode-only step, or
        (auto) that multiple but at least AUTO_FLOOR_S over the pp steps."""
        kind, value = self.itl_target
        if kind == "ms":
            return value / 1000.0 / self.pp_size
        target = value * self.step_costs.decode_step_s(decodes, decode_context)
        return max(target, AUTO_FLOOR_S / self.pp_size) if kind == "auto" else target

    def draft_prices(self, decodes: int, decode_context: int) -> tuple[float, float]:
        """What a proposed token costs, and what a step with proposals pays once, as shares of the
        token a plain step gives each of its `decodes`: a proposal pays when the chance it is
        accepted is above the first, a step's proposals together when their expected tokens are
        above the second (0, 0 until learned)."""
        per_token = self.step_costs.decode_step_s(decodes, decode_context) / max(1, decodes)
        if not per_token > 0:
            return 0.0, 0.0
        row, step = self.step_costs.draft_costs_s()
        return row / per_token, step / per_token

    def learn(self, chunks, launched: float, now: float) -> None:
        """Feed a completed step's duration to the cost model and the step-time histogram. With pp
        steps in flight a step's own time is the gap since the previous completion (its slot in the
        pipeline) or, when it ran alone, its latency over the pp stages."""
        shape = step_shape(chunks)
        if launched >= self._last_complete or self.pp_size == 1:
            seconds = (now - launched) / self.pp_size
        else:
            seconds = now - self._last_complete
        self._last_complete = now
        if shape.prompt_tokens or shape.decodes:
            self.step_costs.observe(shape, seconds)
            self.step_times.observe(shape.kind, seconds)

    def prefill_backlog_s(self, waiting, running) -> Optional[float]:
        """Predicted seconds until the prompts queued here are through (step_cost.prefill_backlog_s:
        every request with more than its next token still to compute, waiting or running). Beside
        running decodes, the ITL target paces prompts to a chunk per step of the target's length,
        which is then the longer figure."""
        left = [
            (r.num_computed, r.num_tokens - r.num_computed)
            for r in (*waiting, *running)
            if r.num_tokens - r.num_computed > 1
        ]
        compute = prefill_backlog_s(self.step_costs, left)
        decodes = [r for r in running if r.num_tokens - r.num_computed <= 1]
        if compute is None or not left or not decodes or self.itl_target is None:
            return compute
        context = sum(r.num_tokens for r in decodes)
        chunk = self.prompt_tokens_within(len(decodes), context, 0)
        if not chunk:
            return compute
        steps = -(-sum(n for _, n in left) // chunk)
        return max(compute, steps * self.step_target_s(len(decodes), context))

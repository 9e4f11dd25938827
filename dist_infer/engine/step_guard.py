"""A request can fail only itself: the step loop's guard against one request's exception.

Which parts of a step can fail a request and serve on depends on who runs them:

- the driver alone builds the plan, checks each request's chunk, samples (pp=1), checks stops
  and detokenizes: an exception there is the driver's own, so it fails the requests concerned
  (an abort with an error), frees their blocks, and the next plan's `freed` list tells the
  followers, the way an abort does;
- the attention metadata is a pure function of the plan, so the driver builds it before the
  plan leaves: a plan that would raise there (on every rank alike) never reaches the followers;
- sampling is retried row by row when the batch raises, so only the rows that raise fail; the
  sampler rank of a pipeline (not the driver) marks them with FAILED_TOKEN on the way back;
- the forward runs on every rank: an exception on one rank while the others wait in a
  collective leaves the ranks disagreeing, so there the instance still dies (the API fails
  over). Only a one-rank instance fails the step's requests instead, and gives up after
  MAX_FORWARD_FAILURES steps in a row (a broken device would otherwise fail every request).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from loguru import logger

from dist_infer.engine.request import Request, RequestOutput
from dist_infer.engine.sampling import RowSampling, SampledTokens
from dist_infer.engine.step_plan import StepPlan

FAILED_TOKEN = -1  # a sampled row that failed (what a pipeline's sampler sends back for it)
MAX_FORWARD_FAILURES = 3  # a one-rank instance's forward failing this many steps in a row ends it


class ForwardFailures(RuntimeError):
    """The forward of a one-rank instance failed MAX_FORWARD_FAILURES steps in a row."""


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def failure_message(request_id: str, where: str, why: str) -> str:
    """What the client sees: its request id, where the step failed, and the exception."""
    return f"request {request_id} failed in {where}: {why}"


def failed_output(r: Request, message: str) -> RequestOutput:
    """The finished output of a failed request: nothing new (what it had is already reported), the error."""
    return RequestOutput(request_id=r.request_id, new_token_ids=[], new_logprobs=[], new_top_logprobs=[],
                         text_delta="", finished=True, finish_reason="abort", stop_reason=None,
                         num_prompt_tokens=len(r.prompt_token_ids), num_generated_tokens=r.emitted_tokens,
                         error=message)


def check_chunk(r: Request, start: int, num_tokens: int, vocab_size: int, max_positions: int,
                num_blocks: int, block_size: int, cp: int) -> list[int]:
    """The chunk's input ids, after checking what would otherwise raise in (or corrupt) the forward
    on every rank: ids in the vocabulary, positions within the model's, block ids within the cache."""
    ids = r.all_token_ids[start:start + num_tokens]
    if len(ids) != num_tokens:
        raise ValueError(f"chunk of {num_tokens} tokens from {start}, the request has {r.num_tokens}")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = [t for t in ids if not 0 <= t < vocab_size][:5]
        raise ValueError(f"token ids {bad} outside the vocabulary of {vocab_size}")
    if start + num_tokens > max_positions:
        raise ValueError(f"{start + num_tokens} tokens, more than the model's {max_positions} positions")
    table = r.block_table
    if table and (min(table) < 0 or max(table) >= num_blocks):
        raise ValueError(f"block ids outside the cache of {num_blocks}")
    if cp == 1 and len(table) * block_size < start + num_tokens:
        raise ValueError(f"{len(table)} blocks of {block_size} cannot hold {start + num_tokens} tokens")
    return ids


def sample_guarded(sample: Callable[..., SampledTokens], logits: torch.Tensor, rows: list[RowSampling],
                   eos_ids: tuple[int, ...]) -> tuple[SampledTokens, dict[int, str]]:
    """Sample the batch; if it raises, sample row by row and mark only the rows that raise
    (token FAILED_TOKEN). Returns the tokens and, per failed row, why."""
    try:
        return sample(logits, rows, eos_ids), {}
    except Exception as exc:  # noqa: BLE001 - a row's parameters may make the sampler raise
        logger.warning(f"sampling a batch of {len(rows)} rows failed ({describe(exc)}); sampling row by row")
    n = max((r.logprobs for r in rows), default=0)
    tokens = torch.full((len(rows),), FAILED_TOKEN, dtype=torch.long)
    logprobs = torch.full((len(rows),), float("nan"), dtype=torch.float64)
    top_ids = torch.zeros(len(rows), n, dtype=torch.long)
    top_logprobs = torch.full((len(rows), n), float("nan"), dtype=torch.float64)
    errors: dict[int, str] = {}
    for b, row in enumerate(rows):
        try:
            one = sample(logits[b:b + 1], [replace(row, logprobs=n)], eos_ids)
        except Exception as exc:  # noqa: BLE001
            errors[b] = describe(exc)
            continue
        tokens[b], logprobs[b] = one.tokens[0], one.logprobs[0]
        if n:
            top_ids[b], top_logprobs[b] = one.top_ids[0], one.top_logprobs[0]
    return SampledTokens(tokens, logprobs, top_ids, top_logprobs), errors


class StepGuard:
    """The driver's bookkeeping of failures: each failed request ends with an error, and
    consecutive forward failures of a one-rank instance are counted."""

    def __init__(self, fail: Callable[[Request, str], RequestOutput]):
        self._fail = fail  # ends a request with an error (the engine frees its blocks)
        self.row_errors: dict[int, dict[int, str]] = {}  # step -> sampled row -> why (pp=1 driver)
        self.forward_failures = 0
        self.failed_requests = 0

    def fail(self, r: Request, where: str, why: str) -> RequestOutput:
        message = failure_message(r.request_id, where, why)
        logger.error(message)
        self.failed_requests += 1
        return self._fail(r, message)

    def fail_all(self, requests: list[Request], where: str, why: str) -> list[RequestOutput]:
        return [self.fail(r, where, why) for r in requests if not r.finished]

    def plan_chunks(self, plan: StepPlan, chunks: list, cfg, num_blocks: int, block_size: int,
                    cp: int) -> tuple[list, list[RequestOutput]]:
        """Add each scheduled chunk to `plan`; a chunk that fails its check (or cannot be planned)
        fails its request alone. Returns the chunks planned, in plan order, and the failures."""
        planned, failed = [], []
        for chunk in chunks:
            r = chunk.request
            try:
                ids = check_chunk(r, chunk.start, chunk.num_tokens, cfg.vocab_size, cfg.max_positions,
                                  num_blocks, block_size, cp)
                row = RowSampling.of(r.params, r.seed, len(r.output_token_ids)) if chunk.sample else None
            except Exception as exc:  # noqa: BLE001 - this request's own input: it fails alone
                failed.append(self.fail(r, "planning its step", describe(exc)))
                continue
            planned.append(chunk)
            plan.seq_ids.append(r.seq_id)
            plan.num_tokens.append(chunk.num_tokens)
            plan.starts.append(chunk.start)
            plan.block_tables.append(list(r.block_table))
            plan.sample.append(chunk.sample)
            plan.input_ids += ids
            if row is not None:
                plan.rows.append(row)
        return planned, failed

    def sample(self, sample: Callable[..., SampledTokens], logits: torch.Tensor, plan: StepPlan,
               eos_ids: tuple[int, ...], keep: bool) -> SampledTokens:
        """The sampler rank's tokens for `plan`, failed rows as FAILED_TOKEN. `keep` (the driver):
        remember why for `take_row_errors`; a pipeline's sampler only logs it (the rows travel back)."""
        sampled, errors = sample_guarded(sample, logits, plan.rows, eos_ids)
        if errors and keep:
            self.row_errors[plan.step] = errors
        elif errors:
            logger.error(f"step {plan.step}: sampling failed for rows {errors}")
        return sampled

    def take_row_errors(self, step: int) -> dict[int, str]:
        """Why each failed row of `step` failed (the driver's own sampling; pp>1: the sampler's log has it)."""
        return self.row_errors.pop(step, {})

    def forward_failed(self, exc: BaseException, world_size: int) -> None:
        """A step's forward raised: re-raise where the ranks may now disagree (more than one rank)
        or where it keeps happening; else the caller fails the step's requests."""
        if world_size > 1:
            raise exc
        self.forward_failures += 1
        if self.forward_failures >= MAX_FORWARD_FAILURES:
            raise ForwardFailures(f"the forward failed {self.forward_failures} steps in a row; "
                                  f"the last: {describe(exc)}") from exc
        logger.opt(exception=exc).error(f"a step's forward failed ({describe(exc)}); failing its requests")

    def forward_ok(self) -> None:
        self.forward_failures = 0

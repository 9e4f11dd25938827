"""A request can fail only itself: the step loop's guard against one request's exception.

Which parts of a step can fail a request and serve on depends on who runs them:

- the driver alone builds the plan, checks each request's chunk, samples (pp=1), checks stops
  and detokenizes: an exception there is the driver's own, so it fails the requests concerned
  (an abort with an error), frees their blocks, and the next plan's `freed` list tells the
  followers, the way an abort does;
- the attention metadata is a pure function of the plan, so the driver builds it before the
  plan leaves: a plan that would raise there (on every rank alike) never reaches the followers;
- sampling is retried row by row when the batch raises, so only the rows that raise fail; the
  sampler rank (the driver, or a pipeline's last stage) gives each a negative token;
- the forward runs on every rank: an exception on one rank while the others wait in a
  collective leaves the ranks disagreeing, so there the instance still dies (the API fails
  over). Only a one-rank instance fails the step's requests instead, and gives up after
  MAX_FORWARD_FAILURES steps in a row (a broken device would otherwise fail every request).

A failed request's error tells the client only its request id, the stage and an error id: the
exception's text may hold anything (tensor contents, paths), so it goes, with its traceback and
that id, to the log of the rank where it happened. A pipeline's sampler rank sends the
id back in the failed row's token slot (`failed_token`), so the driver's client sees the same id.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch
from loguru import logger

from dist_infer.engine.device_io import sampled_to_host
from dist_infer.engine.request import Request, RequestOutput
from dist_infer.engine.sampling import RowSampling, SampledTokens
from dist_infer.engine.step_plan import StepPlan

FAILED_TOKEN = -1  # a sampled row that failed with error id 0; any negative token is a failed row
MAX_FORWARD_FAILURES = 3  # a one-rank instance's forward failing this many steps in a row ends it
ERROR_ID_HEX = 12  # hex digits of an error id (as the HTTP layer's); 48 bits fit a negative int64 token


class ForwardFailures(RuntimeError):
    """The forward of a one-rank instance failed MAX_FORWARD_FAILURES steps in a row."""


def describe(exc: BaseException) -> str:
    """An exception as one line, for the log only (never for a client)."""
    return f"{type(exc).__name__}: {exc}"


def log_exception(exc: BaseException, what: str) -> str:
    """Log `exc` with its traceback under a new error id, at error level; returns the id, which is
    all a client is told (the text may hold tensor contents, paths, a prompt)."""
    error_id = f"err-{secrets.token_hex(ERROR_ID_HEX // 2)}"
    logger.opt(exception=exc).error(f"{what} (error id {error_id}): {describe(exc)}")
    return error_id


def failed_token(error_id: str) -> int:
    """The token a failed row carries: negative, and the error id in it (so it crosses a pipeline)."""
    return -1 - int(error_id.removeprefix("err-"), 16)


def failed_error_id(token: int) -> Optional[str]:
    """The error id a failed row's token carries; None for a real token."""
    return None if token >= 0 else f"err-{-1 - token:0{ERROR_ID_HEX}x}"


def failure_message(request_id: str, where: str, error_id: str) -> str:
    """What the client sees: its request id, where the step failed, the error id to quote."""
    return f"request {request_id} failed in {where} (error id {error_id}; the instance's log has the details)"


def failed_output(r: Request, message: str) -> RequestOutput:
    """The finished output of a failed request: nothing new (what it had is already reported), the error."""
    return RequestOutput(
        request_id=r.request_id,
        new_token_ids=[],
        new_logprobs=[],
        new_top_logprobs=[],
        text_delta="",
        finished=True,
        finish_reason="abort",
        stop_reason=None,
        num_prompt_tokens=len(r.prompt_token_ids),
        num_generated_tokens=r.emitted_tokens,
        error=message,
    )


def check_chunk(
    r: Request,
    start: int,
    num_tokens: int,
    vocab_size: int,
    max_positions: int,
    num_blocks: int,
    block_size: int,
    cp: int,
    draft: Sequence[int] = (),
) -> list[int]:
    """The chunk's input ids, after checking what would otherwise raise in (or corrupt) the forward
    on every rank: ids in the vocabulary, positions within the model's, block ids within the cache.
    `draft`: proposed tokens (speculative decoding) after the request's own, counted in num_tokens."""
    ids = r.all_token_ids[start : start + num_tokens - len(draft)] + list(draft)
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


def sample_guarded(
    sample: Callable[..., SampledTokens],
    logits: torch.Tensor,
    rows: list[RowSampling],
    eos_ids: tuple[int, ...],
    what: str = "sampling",
) -> SampledTokens:
    """Sample the batch; if it raises, sample row by row, so only the rows that raise fail: each
    is logged here (the sampler rank) under its own error id, which its token carries (`failed_token`).
    The row-by-row result is built on the host (its rows are host copies), the batch's stays on the device."""
    try:
        return sample(logits, rows, eos_ids)
    except Exception as exc:  # noqa: BLE001 - a row's parameters may make the sampler raise
        logger.warning(f"{what}: a batch of {len(rows)} rows failed ({describe(exc)}); sampling row by row")
    n = max((r.logprobs for r in rows), default=0)
    tokens = torch.full((len(rows),), FAILED_TOKEN, dtype=torch.long)
    logprobs = torch.full((len(rows),), float("nan"), dtype=torch.float64)
    top_ids = torch.zeros(len(rows), n, dtype=torch.long)
    top_logprobs = torch.full((len(rows), n), float("nan"), dtype=torch.float64)
    for b, row in enumerate(rows):
        try:
            one = sampled_to_host(sample(logits[b : b + 1], [replace(row, logprobs=n)], eos_ids))
        except Exception as exc:  # noqa: BLE001
            tokens[b] = failed_token(log_exception(exc, f"{what}: row {b} of {len(rows)} failed"))
            continue
        tokens[b], logprobs[b] = one.tokens[0], one.logprobs[0]
        if n:
            top_ids[b], top_logprobs[b] = one.top_ids[0], one.top_logprobs[0]
    return SampledTokens(tokens, logprobs, top_ids, top_logprobs)


class StepGuard:
    """The driver's bookkeeping of failures: each failed request ends with an error, and
    consecutive forward failures of a one-rank instance are counted."""

    def __init__(self, fail: Callable[[Request, str], RequestOutput]):
        self._fail = fail  # ends a request with an error (the engine frees its blocks)
        self.forward_failures = 0
        self.failed_requests = 0

    def fail(self, r: Request, where: str, error_id: str) -> RequestOutput:
        """End `r` with an error naming only `error_id` (whose exception is already in the log)."""
        message = failure_message(r.request_id, where, error_id)
        logger.error(message)
        self.failed_requests += 1
        return self._fail(r, message)

    def fail_all(self, requests: list[Request], where: str, exc: BaseException) -> list[RequestOutput]:
        """End `requests` for one exception: logged once, under one error id they all quote."""
        live = [r for r in requests if not r.finished]
        error_id = log_exception(exc, f"{where} failed for requests {[r.request_id for r in live]}")
        return [self.fail(r, where, error_id) for r in live]

    def plan_chunks(
        self, plan: StepPlan, chunks: list, cfg, num_blocks: int, block_size: int, cp: int
    ) -> tuple[list, list[RequestOutput]]:
        """Add each scheduled chunk to `plan`; a chunk that fails its check (or cannot be planned)
        fails its request alone. Returns the chunks planned, in plan order, and the failures."""
        planned, failed = [], []
        for chunk in chunks:
            r = chunk.request
            try:
                ids = check_chunk(
                    r,
                    chunk.start,
                    chunk.num_tokens,
                    cfg.vocab_size,
                    cfg.max_positions,
                    num_blocks,
                    block_size,
                    cp,
                    chunk.draft,
                )
                row = RowSampling.of(r.params, r.seed, len(r.output_token_ids)) if chunk.sample else None
            except Exception as exc:  # noqa: BLE001 - this request's own input: it fails alone
                failed += self.fail_all([r], "planning its step", exc)
                continue
            planned.append(chunk)
            if chunk.layers is not None:
                plan.layered.append((len(plan.seq_ids), *chunk.layers))
            plan.seq_ids.append(r.seq_id)
            plan.num_tokens.append(chunk.num_tokens)
            plan.starts.append(chunk.start)
            plan.block_tables.append(list(r.block_table))
            plan.sample.append((1 + len(chunk.draft)) if chunk.sample else 0)
            plan.prompt_tokens.append(max(0, min(chunk.num_tokens, len(r.prompt_token_ids) - chunk.start)))
            plan.input_ids += ids
            if row is not None:
                plan.rows.append(row)
        return planned, failed

    def sample(
        self, sample: Callable[..., SampledTokens], logits: torch.Tensor, plan: StepPlan, eos_ids: tuple[int, ...]
    ) -> SampledTokens:
        """The sampler rank's tokens for `plan`; a failed row's token is negative and carries the
        error id its exception was logged under here (`failed_error_id` on the driver)."""
        return sample_guarded(sample, logits, plan.position_rows(), eos_ids, f"step {plan.step}: sampling")

    def forward_failed(self, exc: BaseException, world_size: int) -> None:
        """A step's forward raised: re-raise where the ranks may now disagree (more than one rank)
        or where it keeps happening; else the caller fails the step's requests (`fail_all` logs it)."""
        if world_size > 1:
            raise exc
        self.forward_failures += 1
        if self.forward_failures >= MAX_FORWARD_FAILURES:
            raise ForwardFailures(
                f"the forward failed {self.forward_failures} steps in a row; the last: {describe(exc)}"
            ) from exc

    def forward_ok(self) -> None:
        self.forward_failures = 0

"""The masks of a step's constrained rows, computed while the step's forward runs.

The driver plans a step, then starts the masks of its constrained rows on the filler's own
thread and runs the forward; the sampler takes them just before it samples. llguidance computes
with the GIL released (several rows in parallel on its own threads), so the mask is hidden behind
the forward up to the forward's length. Where another rank samples (pipeline parallelism) the
masks travel in the plan instead, filled before it leaves.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

import torch

from dist_infer.engine.structured.counters import StructuredCounters
from dist_infer.engine.structured.matcher import RequestMatcher
from dist_infer.engine.structured.token_mask import allows_only


class PendingMasks:
    """Masks being computed for the plan rows `rows` (a Future of the [len(rows), words] bitmask)."""

    def __init__(self, rows: list[int], future: Future, counters: StructuredCounters):
        self.rows, self._future, self._counters = rows, future, counters

    def result(self) -> torch.Tensor:
        """The masks, once computed (the wait is counted); the fill's exception if it raised."""
        start = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._counters.add(mask_wait_seconds=time.perf_counter() - start)

    def settle(self) -> None:
        """Wait for the fill, whatever it ends with: a step that fails before it samples must not
        leave a fill running on grammar states the driver will use again."""
        try:
            self._future.result()
        except Exception:  # noqa: BLE001 - nobody samples these rows
            pass


class MaskFiller:
    """The driver's: fills the masks of a step's constrained rows with the GIL released; `start`
    does it on a thread of its own, while the caller runs the forward. `parallel`: rows in parallel
    on llguidance's own threads (`threads`; None: its default), for a forward that leaves the host's
    cores free (a GPU's); on a CPU the forward's threads use every core, and a pool of spinning
    workers beside them would slow it more than the masks cost, so rows go one after another.
    Counts its work in `counters`."""

    def __init__(
        self, threads: Optional[int] = None, counters: Optional[StructuredCounters] = None, parallel: bool = True
    ):
        self.threads, self.parallel = threads, parallel
        self.counters = counters if counters is not None else StructuredCounters()
        self._executor = None  # llguidance's LLExecutor, made on first use
        self._thread: Optional[ThreadPoolExecutor] = None

    def fill(self, matchers: Sequence[RequestMatcher]) -> torch.Tensor:
        """[len(matchers), words] int32: row i the tokens matchers[i] allows next."""
        start = time.perf_counter()
        bitmask = self._fill(matchers)
        self.counters.add(mask_steps=1, mask_rows=len(matchers), mask_seconds=time.perf_counter() - start)
        return bitmask

    def start(self, rows: list[int], matchers: Sequence[RequestMatcher]) -> PendingMasks:
        """Fill the masks of plan rows `rows` (their grammar states `matchers`) on the filler's
        thread; the matchers must not be advanced until the result is taken (or `settle`d)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return PendingMasks(list(rows), self._thread.submit(self.fill, list(matchers)), self.counters)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def _fill(self, matchers: Sequence[RequestMatcher]) -> torch.Tensor:
        from llguidance import LLExecutor

        words = matchers[0].words
        if any(m.words != words for m in matchers):
            raise ValueError("the matchers of one step have vocabularies of different sizes")
        bitmask = torch.zeros(len(matchers), words, dtype=torch.int32)
        if len(matchers) == 1 or not self.parallel:
            for i, m in enumerate(matchers):
                m.fill_mask(bitmask, i)
            return bitmask
        if self._executor is None:
            self._executor = LLExecutor(self.threads)
        pairs = [(m.llmatcher(), i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(matchers))
        return bitmask


def only_ending(bitmask: torch.Tensor, eos_ids: Iterable[int]) -> list[bool]:
    """Per row of `bitmask`: whether the grammar allows nothing but EOS (it can only end), where a
    min_tokens ban on EOS must give way."""
    eos = list(eos_ids)
    return [allows_only(row, eos) for row in bitmask]


def lift_eos_bans(rows: Sequence, mask_rows: Sequence[int], masks: torch.Tensor, eos_ids: Iterable[int]) -> None:
    """Where a masked row's grammar allows nothing but EOS, its min_tokens ban on EOS gives way
    (`rows`: the plan's RowSampling, `mask_rows` indexing them, `masks` their bitmasks)."""
    banned = [i for i, b in enumerate(mask_rows) if rows[b].ban_eos]
    if banned:
        for i, only_eos in zip(banned, only_ending(masks[banned], eos_ids)):
            if only_eos:
                rows[mask_rows[i]].ban_eos = 0

"""A request's CPU-heavy steps in worker processes, so the API's event loop keeps answering:
parsing a large body and tokenizing a long prompt.

A thread does not do it: `tokenizers`' encode holds the GIL for the whole call (another thread
gets not one tick meanwhile), and so do freeing the Encoding of millions of tokens, turning its ids
into a list and json.loads of a large prompt (docs/security.md, "Bounded input", "Prompt size before
work", has the figures). So a body of at least POOL_MIN_BODY_BYTES and a prompt of at least
POOL_MIN_CHARS characters go to one of a few spawned processes. The tokenizer is pickled once,
before serving, and loaded once per process. An encoding sends back the ids only when there are at
most `limit` of them, and their count otherwise (the caller refuses the prompt by its count: a
list of millions of ids never crosses back). Less work costs a round trip more than it costs the
GIL and stays in a thread.

The processes start on first use (tests that send nothing large start none). One that dies (the
OOM killer) breaks the executor: the work it held gets a 503, and the next call starts fresh
processes. Where none can start (spawn re-imports the main module, so a script that serves
without an `if __name__ == "__main__"` guard cannot have them) the work goes to threads, as before.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Optional, Union

from loguru import logger

from dist_infer.serving.http.guard import ApiError
from dist_infer.serving.http.json_body import json_result, value_of

POOL_MIN_CHARS = 8192  # a prompt is encoded in a thread below this (tens of ms of GIL at most), in a worker from it
POOL_MIN_BODY_BYTES = 2 << 20  # a body is parsed in a thread below this (json.loads holds the GIL), in a worker from it
DEFAULT_PROCESSES = 2
WORKER_NICENESS = 10  # the workers' nice increment: the event loop's thread wins the CPU

_backend: Any = None  # in a worker process: the tokenizer it encodes with (set once, by _load)


def _load(pickled_backend: Optional[bytes]) -> None:
    """A worker's start: yield the CPU to the server's event loop (a core busy tokenizing must not
    delay /health, as it did at equal priority on busy cores), leave Ctrl-C to the
    server, which ends the workers, and load the tokenizer."""
    global _backend
    os.nice(WORKER_NICENESS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _backend = pickle.loads(pickled_backend) if pickled_backend is not None else None


def _encode(text: str, limit: Optional[int]) -> Union[list[int], int]:
    """In a worker: the ids of `text` (no special tokens), or their count when over `limit`."""
    ids = _backend.encode(text, add_special_tokens=False).ids
    return len(ids) if limit is not None and len(ids) > limit else ids


def _ready() -> bool:
    """A task that only makes its worker start (WorkerPool.warm)."""
    return True


class WorkersUnavailable(RuntimeError):
    """No worker process can be started in this program: the caller does the work in a thread."""


class WorkerPool:
    """A few worker processes that parse bodies and encode with `backend` (None: none to encode
    with; else a picklable object whose `encode(text, add_special_tokens=False).ids` is the
    encoding: a `tokenizers.Tokenizer`)."""

    def __init__(self, backend: Any = None, processes: int = DEFAULT_PROCESSES):
        # pickled here, before serving: pickling a tokenizer holds the GIL (long, for a large vocabulary)
        self._pickled_backend = pickle.dumps(backend) if backend is not None else None
        self.can_encode = backend is not None
        self.processes = processes
        self.unavailable = ""  # why processes cannot be started in this program, once that is known
        self._executor: Optional[ProcessPoolExecutor] = None

    def _running(self) -> ProcessPoolExecutor:
        if self._executor is None:
            logger.info(f"starting {self.processes} worker processes for large bodies and long prompts")
            self._executor = ProcessPoolExecutor(
                self.processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_load,
                initargs=(self._pickled_backend,),
            )
        return self._executor

    async def _run(self, fn, *args) -> Any:
        if self.unavailable:
            raise WorkersUnavailable(self.unavailable)
        executor = self._running()
        try:
            future = executor.submit(fn, *args)
        except RuntimeError as exc:
            self._give_up(exc)
            raise WorkersUnavailable(self.unavailable) from None
        try:
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            if self._executor is executor:
                self._executor = None
                executor.shutdown(wait=False, cancel_futures=True)
            logger.error("a worker process died; the next large request starts new ones")
            raise ApiError(
                503, "the worker process handling this request died; try again", None, {"Retry-After": "1"}
            ) from None

    def warm(self) -> None:
        """Start the workers now, in the background (a server at start-up): a worker's start (its
        interpreter, the tokenizer unpickled) otherwise falls on the first large request, beside it."""
        if self.unavailable:
            return
        try:
            executor = self._running()
            for _ in range(self.processes):
                executor.submit(_ready)
        except RuntimeError as exc:
            self._give_up(exc)

    def _give_up(self, exc: RuntimeError) -> None:
        """Spawn was refused (a main module that starts serving without a __main__ guard): from now
        on the callers work in threads."""
        self.unavailable = f"worker processes cannot start here ({str(exc).strip().splitlines()[0]})"
        logger.error(f"{self.unavailable}; large bodies and long prompts are handled in threads")
        self.close()

    async def parse_json(self, raw: bytes) -> Any:
        """json_body.json_of(raw), in a worker."""
        return value_of(await self._run(json_result, raw))

    async def encode(self, text: str, limit: Optional[int] = None) -> Union[list[int], int]:
        """The ids of `text` without special tokens (the caller adds BOS), or their count if there
        are more than `limit`."""
        return await self._run(_encode, text, limit)

    def close(self) -> None:
        """End the workers now, with whatever they are doing (a server that stops)."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = list((getattr(executor, "_processes", None) or {}).values())  # no public handle
        executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()

"""The bridge between the HTTP server (asyncio, rank 0) and the engine's step loop (a thread).

The step loop runs in its own thread so a forward pass never blocks the event loop; requests
go in through the engine's thread-safe queue, and each step's outputs come back to the
request's asyncio queue on the loop that asked. The API process owns every client's stream:
it sees each delta as it arrives, measures latency there, and turns a client that went away
into an abort.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable, Optional

from loguru import logger

from dist_infer.engine.request import RequestOutput
from dist_infer.engine.sampling import SamplingParams
from dist_infer.serving.errors import EngineDeadError, QueueFullError


class AsyncEngine:
    """What the API server talks to (see serving/api_server.py for the interface it expects)."""

    def __init__(self, engine, model_name: str, tokenizer=None, chat_template: Optional[str] = None,
                 max_queue: int = 1024, on_dead: Optional[Callable[[str], None]] = None):
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.cfg.max_positions
        self.vocab_size = engine.cfg.vocab_size
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_queue = max_queue
        self.dead_reason: Optional[str] = None
        self.accepting = True
        self._on_dead = on_dead
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- the step loop's thread ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.engine.run_driver(self._publish, self._stop.is_set)
        except BaseException as exc:  # noqa: BLE001 - every client must hear about it
            with self._lock:  # a request registering now either sees dead_reason or is failed here
                self.dead_reason = f"{type(exc).__name__}: {exc}"
            logger.error(f"the engine stopped: {self.dead_reason}")
            self._fail_all(EngineDeadError(self.dead_reason))
            if self._on_dead is not None:
                self._on_dead(self.dead_reason)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
        for target, output in targets:
            if target is not None:
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, output)

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for loop, q in streams:
            loop.call_soon_threadsafe(q.put_nowait, error)

    def stop(self, timeout: float = 60.0) -> None:
        """End the step loop (it tells the other ranks to stop) and wait for it."""
        self.accepting = False
        self._stop.set()
        self.engine.wake()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- what the server calls ----------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_token_ids, params)

    def begin_shutdown(self) -> None:
        self.accepting = False

    def stats(self) -> dict:
        return self.engine.stats()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def _num_queued(self) -> int:
        with self._lock:
            open_streams = len(self._streams)
        return max(0, open_streams - self.engine.stats()["num_requests_running"])

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self.accepting:
            raise QueueFullError(retry_after_s=5.0)
        if self._num_queued() >= self.max_queue:
            raise QueueFullError(retry_after_s=1.0)
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            self.engine.add_request(request_id, prompt_token_ids, params)
            while not finished:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.engine.abort(request_id)  # the client went away, or an error: free its blocks

"""The front end's control thread: one asyncio loop for everything that waits on instances
(migration calls and their stage reports, the controller's rounds). Other threads hand it work
with `soon` (a callback) or `submit` (a coroutine whose result they can wait for)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Callable, Coroutine, Optional


class ControlLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread: Optional[threading.Thread] = None

    def start(self, main: Callable[[], Coroutine]) -> None:
        """Run `main()` on the loop's own thread until it returns; then what is still pending
        (migrations) is cancelled and the loop closes."""
        self._thread = threading.Thread(target=self._run, args=(main,), name="cluster-control", daemon=True)
        self._thread.start()

    def _run(self, main: Callable[[], Coroutine]) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(main())
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def soon(self, fn: Callable, *args) -> None:
        """Run fn(*args) on the loop; nothing once the loop has closed (the server stops)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run a coroutine on the loop from another thread; the future gives its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """(on the loop) Start a coroutine as a task of its own."""
        return self.loop.create_task(coro)

    def create_future(self) -> asyncio.Future:
        return self.loop.create_future()

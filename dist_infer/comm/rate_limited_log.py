"""A log that a flood of hostile connections cannot flood.

A listener that logs every refused connection writes as fast as a stranger can reconnect: a flood
of clients reconnecting to the hub wrote a warning line per connection, megabytes of them, and the
writing itself slowed the hub for everyone else (docs/security.md, "What the tests throw at it",
the hub flood row). Here each kind of event (a key: the reason and the source) gets
its first line in full, then at most one line per `interval` that counts what was held back:
"hub: refused 1234 connections from 127.0.0.1 in the last 1.0 s (bad handshake)".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

from loguru import logger

MAX_KEYS = 256  # keys carry addresses: past this many live ones, new keys share one overflow count


@dataclass
class _Window:
    start: float
    count: int  # events since `start` not yet in a line
    summary: str  # a format with {count} and {seconds}


class RateLimitedLog:
    """Per key: the first event of a quiet spell is logged at once with its own message; the ones
    that follow within `interval` are only counted, and their count goes out in one summary line
    when the interval is over (at the next event of that key, or at `flush()`, which a listener
    calls from its loop so the last count of a flood that stopped is not lost); a summary opens
    the next interval, so a steady flood writes one line per interval. A key quiet for a whole
    interval is forgotten: its next event is written in full. `clock` and `emit` are injectable."""

    def __init__(
        self,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        emit: Optional[Callable[[str], None]] = None,
        max_keys: int = MAX_KEYS,
    ):
        self.interval = interval
        self.max_keys = max_keys
        self._clock = clock
        self._emit = emit or (lambda line: logger.opt(depth=2).warning(line))
        self._lock = threading.Lock()
        self._windows: dict[Hashable, _Window] = {}
        self._overflow = 0  # events of keys that found the table full, since the last flush

    def __call__(self, key: Hashable, message: str, summary: str) -> None:
        """One event: `message` if it is the first of a quiet spell, else counted into `summary`
        ("... {count} ... {seconds:.1f} s ..."), which goes out once per interval."""
        now = self._clock()
        lines = []
        with self._lock:
            window = self._windows.get(key)
            if window is not None and now - window.start >= self.interval:
                if window.count:
                    lines.append(window.summary.format(count=window.count, seconds=now - window.start))
                    self._windows[key] = _Window(now, 1, summary)  # this event opens the next window
                else:
                    window = None  # a quiet interval: this event is the first of a new spell
                    del self._windows[key]
            elif window is not None:
                window.count += 1
                window.summary = summary
            if window is None:
                if len(self._windows) >= self.max_keys:
                    self._drop_quiet(now)
                if len(self._windows) >= self.max_keys:
                    self._overflow += 1
                else:
                    self._windows[key] = _Window(now, 0, summary)
                    lines.append(message)
        for line in lines:
            self._emit(line)

    def flush(self) -> None:
        """Write the counts of every window whose interval is over, and forget quiet keys."""
        now = self._clock()
        lines = []
        with self._lock:
            for key, window in list(self._windows.items()):
                if now - window.start < self.interval:
                    continue
                if window.count:  # a next window begins: what comes within it is counted, not written
                    lines.append(window.summary.format(count=window.count, seconds=now - window.start))
                    self._windows[key] = _Window(now, 0, window.summary)
                else:
                    del self._windows[key]
            if self._overflow:
                lines.append(
                    f"{self._overflow} more events from other sources held back from the log "
                    f"(over {self.max_keys} sources at once)"
                )
                self._overflow = 0
        for line in lines:
            self._emit(line)

    def _drop_quiet(self, now: float) -> None:
        """Forget the keys whose interval is over with nothing counted (under the lock)."""
        for key, window in list(self._windows.items()):
            if now - window.start >= self.interval and not window.count:
                del self._windows[key]

"""Which of the hub's new connections may start their handshake now, per source address.

A stranger who reconnects as fast as it can must neither take every handshake slot nor lock a
real instance out. Refusing a failing source at accept would do the second: on one host every
instance comes from 127.0.0.1 too, and a refused join retries a few times while the flood
retries thousands, so it would almost never find the source open. Instead a connection that
may not start yet *waits* (accepted, parked, nothing said to it), and waiting connections start
in arrival order. So a real join waits behind at most the flood's connections that are open at
that moment, never behind its reconnect rate:

- at most `max_handshakes` handshakes at once, and `per_source` of them from one address;
- a source that fails `fail_threshold` handshakes in a row backs off: its connections wait for
  a growing interval (`backoff_first_s`, doubling, at most `backoff_max_s`), so a flood costs a
  few handshakes per interval instead of thousands a second. Failures during a back-off do not
  lengthen it, and the intervals' growth is forgotten after `forget_s` without failures;
- a handshake holds its slot only until the key challenge is passed (the hello that follows is
  read outside the slots), so failing connections never delay one that proved the key;
- a waiting connection that speaks first (a client of multiprocessing waits for the challenge)
  or hangs up is dropped at once, without a thread: that is how a connect-and-close flood ends;
- at most `max_waiting` connections wait (`max_waiting_per_source` from one address), each for
  at most `max_wait_s`; past those caps a connection is closed at accept.

This class only counts; serving/fleet/hub.py holds the sockets. `clock` is injectable for tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Optional


class Verdict(Enum):
    START = "start"  # take a handshake slot now
    WAIT = "wait"  # park until `may_start` says so
    REFUSE = "refuse"  # close at accept: too many waiting


@dataclass(frozen=True)
class AdmissionLimits:
    max_handshakes: int = 16
    per_source: int = 4
    fail_threshold: int = 8
    backoff_first_s: float = 0.05
    backoff_max_s: float = 1.0
    forget_s: float = 30.0
    max_waiting: int = 256
    max_waiting_per_source: int = 64
    max_wait_s: float = 30.0
    max_sources: int = 4096  # sources remembered; past it, those holding nothing are forgotten

    def __post_init__(self):
        for name in (
            "max_handshakes",
            "per_source",
            "fail_threshold",
            "max_waiting",
            "max_waiting_per_source",
            "max_sources",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"hub admission: {name} must be at least 1, not {getattr(self, name)}")


@dataclass
class _Source:
    running: int = 0  # handshakes holding a slot
    waiting: int = 0
    streak: int = 0  # failures in a row
    level: int = 0  # back-offs so far: the next one lasts backoff_first_s * 2**level
    backoff_until: float = 0.0
    last_failure: float = field(default=-float("inf"))


class SourceAdmission:
    """Counts handshakes and waiting connections per source, and each source's back-off."""

    def __init__(self, limits: AdmissionLimits = AdmissionLimits(), clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._sources: dict[str, _Source] = {}
        self.running = 0
        self.waiting = 0

    def arrive(self, source: str) -> Verdict:
        """A connection from `source` was accepted: start it, park it, or close it."""
        if source not in self._sources and len(self._sources) >= self.limits.max_sources:
            self._forget_idle()
        s = self._sources.setdefault(source, _Source())
        if not s.waiting and self._may_run(s):  # an earlier waiting one keeps its place in line
            self._run(s)
            return Verdict.START
        if self.waiting >= self.limits.max_waiting or s.waiting >= self.limits.max_waiting_per_source:
            self._tidy(source, s)
            return Verdict.REFUSE
        s.waiting += 1
        self.waiting += 1
        return Verdict.WAIT

    def may_start(self, source: str) -> bool:
        """A waiting connection from `source` (the oldest of its waiting ones): True takes a slot for it."""
        s = self._sources[source]
        if not self._may_run(s):
            return False
        s.waiting -= 1
        self.waiting -= 1
        self._run(s)
        return True

    def stop_waiting(self, source: str, failed: bool) -> float:
        """A waiting connection was closed: `failed` if it spoke first or hung up (it counts
        against its source), not if it merely waited too long. -> the back-off it began (0: none)."""
        s = self._sources[source]
        s.waiting -= 1
        self.waiting -= 1
        backoff = self._failed(s) if failed else 0.0
        self._tidy(source, s)
        return backoff

    def authenticated(self, source: str) -> None:
        """A handshake proved the key: its slot is free, and its source's failure streak ends."""
        s = self._sources[source]
        self._free(s)
        s.streak = 0
        self._tidy(source, s)

    def failed(self, source: str) -> float:
        """A handshake failed (wrong key, garbage, silence, a reset): its slot is free.
        -> the back-off it began, in seconds (0: none)."""
        s = self._sources[source]
        self._free(s)
        backoff = self._failed(s)
        self._tidy(source, s)
        return backoff

    def backing_off(self, source: str) -> float:
        """Seconds left of `source`'s back-off (0: none)."""
        s = self._sources.get(source)
        return max(0.0, s.backoff_until - self._clock()) if s else 0.0

    def next_backoff_end(self) -> Optional[float]:
        """The clock time the earliest running back-off ends (a parked connection may start then)."""
        now = self._clock()
        ends = [s.backoff_until for s in self._sources.values() if s.backoff_until > now and s.waiting]
        return min(ends) if ends else None

    def sources(self) -> int:
        return len(self._sources)

    def _may_run(self, s: _Source) -> bool:
        return (
            self.running < self.limits.max_handshakes
            and s.running < self.limits.per_source
            and self._clock() >= s.backoff_until
        )

    def _run(self, s: _Source) -> None:
        s.running += 1
        self.running += 1

    def _free(self, s: _Source) -> None:
        s.running -= 1
        self.running -= 1

    def _failed(self, s: _Source) -> float:
        now = self._clock()
        if now - s.last_failure > self.limits.forget_s:
            s.level = 0
        s.last_failure = now
        if now < s.backoff_until:
            return 0.0  # failures of connections let in before the back-off began: they do not lengthen it
        s.streak += 1
        if s.streak < self.limits.fail_threshold:
            return 0.0
        s.streak = 0
        backoff = min(self.limits.backoff_max_s, self.limits.backoff_first_s * 2**s.level)
        s.backoff_until = now + backoff
        s.level = min(s.level + 1, 32)
        return backoff

    def _forget_idle(self) -> None:
        """Forget every source that holds nothing, back-offs and streaks included: many addresses
        (an IPv6 range) must not grow the table without bound, and each is still capped by its
        handshakes and waiting connections."""
        for source, s in list(self._sources.items()):
            if not s.running and not s.waiting:
                del self._sources[source]

    def _tidy(self, source: str, s: _Source) -> None:
        """Forget a source that holds nothing and whose failures no longer matter."""
        now = self._clock()
        if (
            not s.running
            and not s.waiting
            and not s.streak
            and now >= s.backoff_until
            and now - s.last_failure > self.limits.forget_s
        ):
            del self._sources[source]

"""The SLO autoscaler (`serve --autoscale MIN:MAX --slo ttft=S,tpot=S`): the fleet grows when its
requests' latency passes the SLO and shrinks, by draining an instance with live migration, when it
has stayed well under it. No request is dropped or restarted by a scale-down: a stopped instance
first hands every request it holds to the others (serving/fleet/admin_ops.py `stop_instance`).

The policy is pure (`AutoscalePolicy.decide` on a `FleetSample`), tested without processes:

- up, when the windowed p90 TTFT or p90 time per output token passes its SLO, or a request has
  waited longer than the TTFT SLO for its first token (the queue's wait, seen before it ends), or
  the queue's predicted wait passes it (the prompts queued at the least backlogged instance, times
  the per-token prefill cost its engine learned: seen as a burst arrives, before anyone waited),
  and no instance is starting yet, below MAX, and the next instance's ranks fit --max-ranks
  (serving/placement/rank_budget.py; at the bound nothing is tried until ranks free up);
- down, when for `low_for_s` every sample's p90s (over its last `low_for_s` seconds, so a burst's
  slow first tokens still in the up window do not hold it back) were under `low_water` x the SLO, nothing was
  queued, and the requests running would leave at most `low_running` per instance on one instance
  fewer (latency alone is low right after a scale-up met a burst that is still going on), above MIN;
- the flap guard: after any decision, nothing for `cooldown_s`; the p90s an up looks at count only
  the requests that got their first token after the last decision (the window's older ones
  describe the fleet before it: a burst met by one instance must not add back the instance a
  scale-down just removed); and the gap between the up threshold (the SLO) and the down one
  (low_water x SLO) is the hysteresis, so one noisy window neither adds nor removes.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Optional


class AutoscaleError(ValueError):
    """A bad --autoscale or --slo value; the message names the flag."""


@dataclass(frozen=True)
class SLO:
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None

    def describe(self) -> str:
        parts = [f"{k}={v:g}" for k, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s)) if v is not None]
        return ",".join(parts)


def parse_slo(text: str) -> SLO:
    """'ttft=2,tpot=0.1' (seconds) -> SLO; at least one of the two."""
    values: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.partition("=")
        if key not in ("ttft", "tpot") or not value:
            raise AutoscaleError(f"--slo {text!r}: expected ttft=SECONDS and/or tpot=SECONDS, got {part!r}")
        try:
            seconds = float(value)
        except ValueError:
            raise AutoscaleError(f"--slo {text!r}: {key} must be a number of seconds, got {value!r}") from None
        if not (seconds > 0 and math.isfinite(seconds)):
            raise AutoscaleError(f"--slo {text!r}: {key} must be positive, got {value}")
        values[key] = seconds
    if not values:
        raise AutoscaleError(f"--slo {text!r}: give ttft=SECONDS and/or tpot=SECONDS")
    return SLO(values.get("ttft"), values.get("tpot"))


def parse_autoscale(text: str) -> tuple[int, int]:
    """'MIN:MAX' -> (min, max) instances, 1 <= min <= max."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = int(lo), int(hi)
    except ValueError:
        bounds = None
    if not sep or bounds is None or not 1 <= bounds[0] <= bounds[1]:
        raise AutoscaleError(f"--autoscale {text!r}: expected MIN:MAX instances with 1 <= MIN <= MAX, e.g. 1:3")
    return bounds


@dataclass(frozen=True)
class FleetSample:
    """What the policy sees at one tick."""

    now: float
    serving: int  # instances taking requests
    starting: int  # instances placed or restarting, not yet joined
    ttft_p90: Optional[float]  # over the window; None: no first token in it
    tpot_p90: Optional[float]
    oldest_wait_s: float  # the longest a request now waiting for its first token has waited
    queued: int  # requests without their first token yet
    running: int = 0  # requests the fleet holds (streaming or waiting)
    recent_ttft_p90: Optional[float] = None  # the p90s over the last low_for_s seconds only (None: no sample)
    recent_tpot_p90: Optional[float] = None
    predicted_wait_s: float = 0.0  # the prompt compute queued ahead of a request arriving now
    can_grow: bool = True  # the next instance's ranks fit --max-ranks beside those running


@dataclass(frozen=True)
class Decision:
    at: float
    action: str  # "up" | "down"
    reason: str
    instances: int  # serving + starting before it


@dataclass
class AutoscalePolicy:
    min_instances: int
    max_instances: int
    slo: SLO
    cooldown_s: float = 10.0
    low_water: float = 0.5
    low_for_s: float = 15.0
    low_running: float = 2.0
    _last_action: float = field(default=-math.inf, repr=False)
    _low_since: Optional[float] = field(default=None, repr=False)
    held_back: Optional[str] = field(default=None, repr=False)  # the last sample's up reason, not acted on: no ranks

    @property
    def last_action_at(self) -> float:
        """When the last decision was taken (-inf: none yet)."""
        return self._last_action

    def decide(self, s: FleetSample) -> Optional[Decision]:
        """The action for this sample, or None; an action starts the cool-down."""
        fleet = s.serving + s.starting
        over = self._over_slo(s)
        low = self._under_low_water(s) and s.running <= self.low_running * max(1, fleet - 1)
        low_since = (self._low_since if self._low_since is not None else s.now) if low else None
        self._low_since = low_since
        self.held_back = None
        if s.now - self._last_action < self.cooldown_s:
            return None
        up = None
        if fleet < self.min_instances:
            up = f"{fleet} instance(s), fewer than --autoscale's minimum {self.min_instances}"
        elif over is not None and fleet < self.max_instances and s.starting == 0:
            up = over
        if up is not None and not s.can_grow:
            self.held_back = up  # nothing is tried, and no cool-down begins
            return None
        decision = None
        if up is not None:
            decision = Decision(s.now, "up", up, fleet)
        elif (
            low_since is not None
            and fleet > self.min_instances
            and s.starting == 0  # (set: it is low)
            and s.now - low_since >= self.low_for_s
        ):
            decision = Decision(
                s.now,
                "down",
                f"p90 latency under {self.low_water:g} x the SLO, nothing queued and "
                f"{s.running} request(s) running for {s.now - low_since:.0f} s",
                fleet,
            )
        if decision is not None:
            self._last_action, self._low_since = s.now, None
        return decision

    def _over_slo(self, s: FleetSample) -> Optional[str]:
        slo = self.slo
        if slo.ttft_s is not None and s.ttft_p90 is not None and s.ttft_p90 > slo.ttft_s:
            return f"p90 TTFT {s.ttft_p90:.3g} s over the SLO's {slo.ttft_s:g} s"
        if slo.ttft_s is not None and s.oldest_wait_s > slo.ttft_s:
            return f"a request has waited {s.oldest_wait_s:.3g} s for its first token (SLO {slo.ttft_s:g} s)"
        if slo.ttft_s is not None and s.predicted_wait_s > slo.ttft_s:
            return (
                f"the queued prompts predict a {s.predicted_wait_s:.3g} s wait for a first token (SLO {slo.ttft_s:g} s)"
            )
        if slo.tpot_s is not None and s.tpot_p90 is not None and s.tpot_p90 > slo.tpot_s:
            return f"p90 time per output token {s.tpot_p90 * 1e3:.3g} ms over the SLO's {slo.tpot_s * 1e3:g} ms"
        return None

    def _under_low_water(self, s: FleetSample) -> bool:
        slo, k = self.slo, self.low_water
        if s.queued:
            return False
        if slo.ttft_s is not None and s.recent_ttft_p90 is not None and s.recent_ttft_p90 > k * slo.ttft_s:
            return False
        return not (slo.tpot_s is not None and s.recent_tpot_p90 is not None and s.recent_tpot_p90 > k * slo.tpot_s)


def p90(values: list[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


class LatencyWindow:
    """TTFTs and per-token gaps of the last `window_s` seconds (thread-safe: the readers record, the
    control loop reads)."""

    def __init__(self, window_s: float = 10.0, limit: int = 100_000):
        self.window_s = window_s
        self._ttft: deque[tuple[float, float]] = deque(maxlen=limit)
        self._tpot: deque[tuple[float, float]] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def record(self, now: float, ttft: Optional[float] = None, gap: Optional[float] = None, tokens: int = 1) -> None:
        with self._lock:
            if ttft is not None:
                self._ttft.append((now, ttft))
            if gap is not None and tokens > 0:
                self._tpot.append((now, gap / tokens))

    def p90s(self, now: float, span: Optional[float] = None) -> tuple[Optional[float], Optional[float]]:
        """(TTFT p90, TPOT p90) over the window, or over its last `span` seconds."""
        start = now - self.window_s
        recent = now - span if span is not None else start
        with self._lock:
            for q in (self._ttft, self._tpot):
                while q and q[0][0] < start:
                    q.popleft()
            return (p90([v for t, v in self._ttft if t >= recent]), p90([v for t, v in self._tpot if t >= recent]))

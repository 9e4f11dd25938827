"""The autoscaler's hands (policy: serving/placement/autoscale_policy.py): each control-loop tick it samples the
fleet from the cluster, asks the policy, and acts through the admin operations any operator has:
up restarts a stopped instance (or adds one of the fleet's layout, placed by the spawner: locally
or by Ray), down stops the least busy serving instance, which drains live first. Every decision is
logged with its reason, counted for /metrics and listed in /admin/instances. An up whose instance's
ranks would pass --max-ranks is not tried: logged and listed once, until ranks free up."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Optional

from loguru import logger

from dist_infer.serving.fleet.instance_specs import parse_instances
from dist_infer.serving.fleet.interface import AdminError
from dist_infer.serving.fleet.wire import InstanceState
from dist_infer.serving.placement.autoscale_policy import AutoscalePolicy, Decision, FleetSample

TICK_S = 1.0  # how often the fleet is sampled


class Autoscaler:
    def __init__(self, cluster, policy: AutoscalePolicy, layout: str):
        self.cluster, self.policy, self.layout = cluster, policy, layout
        self.layout_ranks = parse_instances(layout)[0].size
        self.decisions: deque[dict] = deque(maxlen=100)
        self.counts: Counter = Counter()  # action -> decisions taken
        self.at_rank_bound = False  # an up was held back by --max-ranks, and no rank has freed since
        self._last_tick = 0.0

    def tick(self, now: Optional[float] = None) -> Optional[Decision]:
        """Called by the cluster's control loop; at most once per TICK_S it samples and decides. The
        action runs on a thread of its own: placing an instance (Ray) may take seconds."""
        now = time.monotonic() if now is None else now
        if now - self._last_tick < TICK_S:
            return None
        self._last_tick = now
        sample = self.sample(now)
        decision = self.policy.decide(sample)
        self._note_rank_bound(sample)
        if decision is not None:
            threading.Thread(
                target=self.act, args=(decision,), daemon=True, name=f"autoscale-{decision.action}"
            ).start()
        return decision

    def sample(self, now: float) -> FleetSample:
        c = self.cluster
        states = [x.state for x in c.instances]
        since = now - self.policy.last_action_at  # the window's older samples are the fleet before it
        ttft, tpot = c.latency.p90s(now, since if since < c.latency.window_s else None)
        recent = c.latency.p90s(now, self.policy.low_for_s)
        waiting = c.first_token_waits(now)
        backlogs = [x.stats.prefill_backlog_s or 0.0 for x in c.instances if x.accepting]
        return FleetSample(
            now=now,
            serving=len(backlogs),
            starting=states.count(InstanceState.STARTING),
            ttft_p90=ttft,
            tpot_p90=tpot,
            oldest_wait_s=max(waiting, default=0.0),
            queued=len(waiting),
            running=c.num_open(),
            recent_ttft_p90=recent[0],
            recent_tpot_p90=recent[1],
            predicted_wait_s=min(backlogs, default=0.0),  # where dispatch would put a new one
            can_grow=self._next_fits(),
        )

    def _next_ranks(self) -> int:
        """The ranks of the instance an up would start: the first stopped one, else one of the layout."""
        stopped = [x for x in self.cluster.instances if x.state == InstanceState.STOPPED and x.spec is not None]
        return stopped[0].spec.size if stopped else self.layout_ranks

    def _next_fits(self) -> bool:
        free = self.cluster.ranks_free()
        return free is None or self._next_ranks() <= free

    def _note_rank_bound(self, sample: FleetSample) -> None:
        """An up held back by --max-ranks is logged and listed once, not at every tick, until ranks free up."""
        if sample.can_grow:
            if self.at_rank_bound:
                logger.info("autoscale: ranks are free again under --max-ranks; scale-ups resume")
            self.at_rank_bound = False
            return
        if self.policy.held_back is None or self.at_rank_bound:
            return
        self.at_rank_bound = True
        outcome = (
            f"not done: the next instance needs {self._next_ranks()} ranks and "
            f"{self.cluster.ranks_free()} are free under --max-ranks; none is started until ranks free up"
        )
        self.decisions.append(
            {
                "at": time.time(),
                "action": "up",
                "reason": self.policy.held_back,
                "instance": None,
                "instances_before": sample.serving + sample.starting,
                "outcome": outcome,
            }
        )
        self.counts["up_at_rank_bound"] += 1
        logger.warning(f"autoscale up: {self.policy.held_back}; {outcome}")

    def act(self, decision: Decision) -> None:
        try:
            index = self._scale_up() if decision.action == "up" else self._scale_down()
        except AdminError as exc:
            index, outcome = None, f"not done: {exc}"
        else:
            outcome = "no instance to act on" if index is None else "done"
        entry = {
            "at": time.time(),
            "action": decision.action,
            "reason": decision.reason,
            "instance": index,
            "instances_before": decision.instances,
            "outcome": outcome,
        }
        self.decisions.append(entry)
        self.counts[decision.action if outcome == "done" else f"{decision.action}_failed"] += 1
        log = logger.info if outcome == "done" else logger.warning
        log(f"autoscale {decision.action}: {decision.reason}; instance {index}: {outcome}")

    def _scale_up(self) -> Optional[int]:
        stopped = [x for x in self.cluster.instances if x.state == InstanceState.STOPPED]
        if stopped:
            return self.cluster.restart_instance(stopped[0].index)["index"]
        return self.cluster.add_instance(self.layout)["index"]

    def _scale_down(self) -> Optional[int]:
        serving = [x for x in self.cluster.instances if x.state == InstanceState.SERVING and not x.draining]
        if len(serving) <= 1:
            return None
        idle = min(serving, key=lambda x: (x.stats.num_requests_running + x.stats.num_requests_waiting, -x.index))
        return self.cluster.stop_instance(idle.index)["index"]

    def describe(self) -> dict:
        p = self.policy
        return {
            "min": p.min_instances,
            "max": p.max_instances,
            "slo": p.slo.describe(),
            "cooldown_s": p.cooldown_s,
            "low_water": p.low_water,
            "low_for_s": p.low_for_s,
            "low_running": p.low_running,
            "at_rank_bound": self.at_rank_bound,
            "decisions": list(self.decisions),
            "counts": dict(self.counts),
        }

"""What operators do through /admin: describe the instances, force a migration, drain, stop,
restart and add instances (each started as a job of its own by the spawner, bounded by
--max-instances, and by --max-ranks before anything starts: serving/placement/rank_budget.py). Thread-safe:
called from the HTTP server's loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Optional

from loguru import logger

from dist_infer.serving.fleet.instance_record import InstanceClient
from dist_infer.serving.fleet.instance_specs import InstancesError, InstanceSpec, TooManyRanks, parse_instances
from dist_infer.serving.fleet.interface import AdminError
from dist_infer.serving.fleet.lifecycle import LIVING
from dist_infer.serving.fleet.wire import InstanceState
from dist_infer.serving.migration.live_migration import MODES
from dist_infer.serving.placement.rank_budget import RankBudget, RankBudgetError

STOPPED_OR_DEAD = (InstanceState.DEAD, InstanceState.STOPPED)  # what an operator may start again


class InstanceAdmin:
    """Cluster's admin part."""

    def describe_instances(self) -> list[dict]:
        with self._lock:
            moving = {r: rec.moving for r, rec in self._requests.items() if rec.moving is not None}
            owner = {r: rec.owner for r, rec in self._requests.items() if rec.owner is not None}
        out = []
        for c in self.instances:
            d = c.describe()
            d["requests"] = [r for r, i in owner.items() if i == c.index]  # the API's routing: up to date
            d["migrating"] = [r for r, (s, t) in moving.items() if c.index in (s, t)]
            out.append(d)
        return out

    def _instance(self, index: int) -> InstanceClient:
        if not 0 <= index < len(self.instances):
            raise AdminError(404, f"instance {index} does not exist (there are {len(self.instances)})")
        return self.instances[index]

    def migrate_now(self, request_id: str, to_instance: int, mode: str = "live") -> concurrent.futures.Future:
        """Force one migration (operators, tests, benchmarks); the future gives its MigrationResult."""
        if mode not in MODES:
            raise AdminError(400, f"mode {mode!r} is not one of {MODES}")
        if not 0 <= to_instance < len(self.instances):
            raise AdminError(400, f"to_instance {to_instance} is not one of the {len(self.instances)} instances")
        with self._lock:
            rec = self._requests.get(request_id)
            src = rec.owner if rec is not None else None
            moving = rec is not None and rec.moving is not None
        if src is None:
            raise AdminError(404, f"request {request_id!r} is not running or waiting on any instance")
        if moving:
            raise AdminError(409, f"request {request_id!r} is already migrating")
        if src == to_instance:
            raise AdminError(400, f"request {request_id!r} is already on instance {to_instance}")
        dst = self.instances[to_instance]
        if not dst.accepting:
            raise AdminError(409, f"instance {to_instance} takes no requests ({dst.state}"
                                  f"{', draining' if dst.draining else ''})")
        if not self.instances[src].alive:
            raise AdminError(409, f"request {request_id!r} is on instance {src}, which is {self.instances[src].state}")
        return asyncio.run_coroutine_threadsafe(self._migrate(request_id, src, to_instance, "manual", mode), self.loop)

    def _others_accepting(self, index: int) -> list[InstanceClient]:
        return [c for c in self.instances if c.index != index and c.accepting]

    def drain(self, index: int) -> dict:
        """Stop dispatching to an instance and move everything on it elsewhere."""
        client = self._instance(index)
        if not client.alive:
            raise AdminError(409, f"instance {index} is {client.state}")
        others = self._others_accepting(index)
        if not others:
            raise AdminError(409, f"instance {index} is the last one taking requests; nowhere to drain it to")
        client.draining = True
        logger.info(f"draining instance {index}: its requests move to instances {[c.index for c in others]}")
        return client.describe()

    def stop_instance(self, index: int) -> dict:
        """Scale down: drain the instance, then stop it once it holds nothing (no request is lost)."""
        client = self._instance(index)
        if client.state != InstanceState.SERVING:
            raise AdminError(409, f"instance {index} is {client.state}")
        self.drain(index)
        client.state = InstanceState.STOPPING
        logger.info(f"stopping instance {index} once it is drained")
        return client.describe()

    def restart_instance(self, index: int) -> dict:
        """Start a dead or stopped instance again (a job of its own, on this host); it rejoins dispatch
        once its driver connects."""
        client = self._instance(index)
        if client.state not in STOPPED_OR_DEAD:
            raise AdminError(409, f"instance {index} is {client.state}; only a dead or stopped one can be restarted")
        self._can_spawn()
        budget = self.rank_budget()
        with self._lock:
            if client.state not in STOPPED_OR_DEAD:
                raise AdminError(409, f"instance {index} is {client.state}; it is being restarted already")
            self._claim_ranks(budget, f"layout {client.spec.describe()}", client.spec.size, client)
            client.state = InstanceState.STARTING
        return self._spawn(client, client.spec, "restart")

    def add_instance(self, layout: str) -> dict:
        """Scale up: start one more instance of `layout` (like one --instances item, e.g. tp=1 or
        decode:tp=2), if its ranks fit the rank budget beside those running."""
        self._can_spawn()
        budget = self.rank_budget()
        try:
            specs = parse_instances(layout, max_ranks=budget.limit if budget else None)
        except TooManyRanks as exc:  # never fits: refused before the rest of a long layout is read
            with self._lock:
                self._claim_ranks(budget, f"layout {layout[:80]}", exc.ranks)  # the message with the ranks running
            raise AdminError(400, str(exc)) from None
        except InstancesError as exc:
            raise AdminError(400, str(exc)) from None
        if len(specs) != 1:
            raise AdminError(400, f"layout {layout!r}: one instance at a time")
        with self._lock:
            if len(self.instances) >= self.max_instances:
                raise AdminError(409, f"the server has {len(self.instances)} instances, --max-instances "
                                      f"{self.max_instances}; restart a dead or stopped one instead")
            self._claim_ranks(budget, f"layout {specs[0].describe()}", specs[0].size)
            client = InstanceClient(len(self.instances), spec=specs[0])  # STARTING: its ranks are counted
            self.instances.append(client)
        return self._spawn(client, specs[0], "scale-up")

    def rank_budget(self) -> Optional[RankBudget]:
        """The rank budget now (asked anew each time: a Ray cluster grows and shrinks); None: unbounded."""
        return self._rank_capacity() if self._rank_capacity is not None else None

    def ranks_held(self, excluding: Optional[InstanceClient] = None) -> int:
        """The ranks of the instances running or starting (a stopping one still runs; a dead or
        stopped one holds none)."""
        with self._lock:
            return sum(c.spec.size if c.spec else 1 for c in self.instances if c.state in LIVING and c is not excluding)

    def ranks_free(self) -> Optional[int]:
        """Ranks a start may still take; None: no budget."""
        budget = self.rank_budget()
        return None if budget is None else budget.room(self.ranks_held())

    def describe_ranks(self) -> dict:
        budget = self.rank_budget()
        return {"running": self.ranks_held(), "max": budget.limit if budget else None,
                "origin": (budget.origin or "--max-ranks") if budget else None}

    def _claim_ranks(self, budget: Optional[RankBudget], what: str, need: int,
                     client: Optional[InstanceClient] = None) -> None:
        """(lock held, so two starts cannot both take the last ranks) AdminError unless `need` more
        ranks fit the budget beside those running or starting, `client`'s own left out: 400 when
        they never fit, 409 when they would once others stop."""
        if budget is None:
            return
        try:
            budget.check(what, need, self.ranks_held(excluding=client))
        except RankBudgetError as exc:
            logger.warning(f"refused to start an instance: {exc}")
            raise AdminError(409 if exc.ever_fits else 400, str(exc)) from None

    def _can_spawn(self) -> None:
        if self._spawner is None:
            raise AdminError(501, "this server cannot start instances (start one with `dist-infer serve --join`)")

    def _spawn(self, client: InstanceClient, spec: InstanceSpec, why: str) -> dict:
        """Start `client`'s job; the caller made it STARTING under the lock once its ranks fit."""
        if why == "restart":
            client.restarts += 1
        logger.info(f"starting instance {client.index} ({spec.describe()}, {why})")
        try:
            client.process = self._spawner(client.index, spec)
        except Exception as exc:  # noqa: BLE001 - the operator sees why
            self._start_failed(client, client.process, f"could not start: {exc}")
            raise AdminError(500, f"instance {client.index} could not start: {exc}") from None
        threading.Thread(target=self._watch_start, args=(client, client.process), daemon=True,
                         name=f"instance-{client.index}-start").start()
        return client.describe()

    def _watch_start(self, client: InstanceClient, process) -> None:
        """A started job that exits, or does not join within join_timeout_s, has failed to start."""
        import subprocess

        try:
            code = f"exited with code {process.wait(self.join_timeout_s)}"
        except subprocess.TimeoutExpired:
            code = f"did not join within {self.join_timeout_s:g} s (stopped)"
        if self._start_failed(client, process, f"its job {code} before joining") and process.poll() is None:
            process.kill()

    def _start_failed(self, client: InstanceClient, process, why: str) -> bool:
        """Instance `client`, starting as `process`, did not start: it is dead, and once no instance
        is starting the requests parked for one go on elsewhere (or fail, saying so). False: it had
        joined, or another start took over, meanwhile."""
        with self._lock:
            if client.process is not process or client.state != InstanceState.STARTING:
                return False
            client.state, client.dead = InstanceState.DEAD, why
            parked = [] if any(c.state == InstanceState.STARTING for c in self.instances) else self._unpark()
        logger.error(f"instance {client.index}: {why}")
        for request_id in parked:
            self._redispatch(request_id, f"instance {client.index} could not start")
        return True

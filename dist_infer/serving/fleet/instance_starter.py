"""Starting instances as jobs of their own (restart, scale-up, --auto-restart): each start is
bounded by --max-ranks before anything runs (serving/placement/rank_budget.py), watched until its
driver joins, and, when it fails, the requests parked for it go on elsewhere."""

from __future__ import annotations

import subprocess
import threading
from typing import Callable, Optional

from loguru import logger

from dist_infer.serving.fleet.config import FleetConfig
from dist_infer.serving.fleet.fleet_state import LIVING, FleetState
from dist_infer.serving.fleet.instance_record import InstanceClient, InstanceJob
from dist_infer.serving.fleet.instance_specs import InstanceSpec
from dist_infer.serving.fleet.interface import AdminError
from dist_infer.serving.fleet.wire import InstanceState
from dist_infer.serving.placement.rank_budget import RankBudget, RankBudgetError

Spawner = Callable[[int, InstanceSpec], InstanceJob]  # starts instance i as a job of its own; returns its process
Redispatch = Callable[[str, str], None]  # (request id, why): send a request whose instance is gone elsewhere
MAX_AUTO_RESTARTS = 3  # --auto-restart's attempts for an instance that keeps dying before it serves


class InstanceStarter:
    def __init__(
        self,
        fleet: FleetState,
        config: FleetConfig,
        spawner: Optional[Spawner],
        rank_capacity: Optional[Callable[[], RankBudget]],
        redispatch: Redispatch,
    ):
        self.fleet, self.config = fleet, config
        self.spawner = spawner
        self.rank_capacity = rank_capacity  # -> the rank budget every start must fit (None: unbounded)
        self.redispatch = redispatch

    # -- the rank budget ---------------------------------------------------------------------------
    def rank_budget(self) -> Optional[RankBudget]:
        """The rank budget now (asked anew each time: a Ray cluster grows and shrinks); None: unbounded."""
        return self.rank_capacity() if self.rank_capacity is not None else None

    def ranks_held(self, excluding: Optional[InstanceClient] = None) -> int:
        """The ranks of the instances running or starting (a stopping one still runs; a dead or
        stopped one holds none)."""
        with self.fleet.lock:
            return sum(c.spec.size for c in self.fleet.instances if c.state in LIVING and c is not excluding)

    def ranks_free(self) -> Optional[int]:
        """Ranks a start may still take; None: no budget."""
        budget = self.rank_budget()
        return None if budget is None else budget.room(self.ranks_held())

    def describe_ranks(self) -> dict:
        budget = self.rank_budget()
        return {
            "running": self.ranks_held(),
            "max": budget.limit if budget else None,
            "origin": (budget.origin or "--max-ranks") if budget else None,
        }

    def claim_ranks(
        self, budget: Optional[RankBudget], what: str, need: int, client: Optional[InstanceClient] = None
    ) -> None:
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

    # -- starting ----------------------------------------------------------------------------------
    def check_can_spawn(self) -> None:
        if self.spawner is None:
            raise AdminError(501, "this server cannot start instances (start one with `dist-infer serve --join`)")

    def spawn(self, client: InstanceClient, spec: InstanceSpec, why: str) -> dict:
        """Start `client`'s job; the caller made it STARTING under the lock once its ranks fit."""
        if why == "restart":
            client.restarts += 1
        logger.info(f"starting instance {client.index} ({spec.describe()}, {why})")
        spawner = self.spawner
        try:
            if spawner is None:  # (the callers ask check_can_spawn first)
                raise RuntimeError("this server cannot start instances")
            client.process = spawner(client.index, spec)
        except Exception as exc:  # noqa: BLE001 - the operator sees why
            self.start_failed(client, client.process, f"could not start: {exc}")
            raise AdminError(500, f"instance {client.index} could not start: {exc}") from None
        threading.Thread(
            target=self._watch_start, args=(client, client.process), daemon=True, name=f"instance-{client.index}-start"
        ).start()
        return client.describe()

    def _watch_start(self, client: InstanceClient, process: InstanceJob) -> None:
        """A started job that exits, or does not join within join_timeout_s, has failed to start."""
        timeout = self.config.join_timeout_s
        try:
            code = f"exited with code {process.wait(timeout)}"
        except subprocess.TimeoutExpired:
            code = f"did not join within {timeout:g} s (stopped)"
        if self.start_failed(client, process, f"its job {code} before joining") and process.poll() is None:
            process.kill()

    def start_failed(self, client: InstanceClient, process: Optional[InstanceJob], why: str) -> bool:
        """Instance `client`, starting as `process`, did not start: it is dead, and once no instance
        is starting the requests parked for one go on elsewhere (or fail, saying so). False: it had
        joined, or another start took over, meanwhile."""
        with self.fleet.lock:
            if client.process is not process or client.state != InstanceState.STARTING:
                return False
            client.state, client.dead = InstanceState.DEAD, why
            parked = [] if self.fleet.any_starting() else self.fleet.unpark()
        logger.error(f"instance {client.index}: {why}")
        for request_id in parked:
            self.redispatch(request_id, f"instance {client.index} could not start")
        return True

    # -- --auto-restart ----------------------------------------------------------------------------
    def restarts_on_death(self, client: InstanceClient) -> bool:
        """--auto-restart: a dead instance is started again (placed anew by the spawner), up to
        MAX_AUTO_RESTARTS times in a row without serving in between; not while the server stops."""
        return (
            self.config.auto_restart
            and self.spawner is not None
            and self.fleet.accepting
            and client.auto_restarts < MAX_AUTO_RESTARTS
        )

    def restart_dead(self, client: InstanceClient, reason: str) -> None:
        """Give the dead job's resources back (its Ray placement group), then start it again."""
        old, client.auto_restarts = client.process, client.auto_restarts + 1
        if old is not None:
            try:
                old.kill()
            except Exception as exc:  # noqa: BLE001 - a job already gone
                logger.debug(f"instance {client.index}: ending its dead job: {exc!r}")
        logger.warning(
            f"instance {client.index} died ({reason}); --auto-restart starts it again "
            f"(attempt {client.auto_restarts} of {MAX_AUTO_RESTARTS})"
        )
        try:
            budget = self.rank_budget()
            with self.fleet.lock:  # STARTING since it died: its own ranks are left out, the others' counted
                self.claim_ranks(budget, f"layout {client.spec.describe()}", client.spec.size, client)
        except Exception as exc:  # noqa: BLE001 - AdminError: past --max-ranks (the others grew meanwhile)
            self.start_failed(client, client.process, f"--auto-restart did not start it again: {exc}")
            return
        try:
            self.spawn(client, client.spec, "restart")
        except Exception as exc:  # noqa: BLE001 - spawn marked it dead, logged why and released what waited for it
            logger.error(f"instance {client.index}: the automatic restart failed: {exc}")

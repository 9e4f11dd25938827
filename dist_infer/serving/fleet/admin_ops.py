"""What operators do through /admin: describe the instances, force a migration, drain, stop,
restart and add instances (each started as a job of its own by the starter, bounded by
--max-instances, and by --max-ranks before anything starts: serving/placement/rank_budget.py). Thread-safe:
called from the HTTP server's loop."""

from __future__ import annotations

import concurrent.futures

from loguru import logger

from dist_infer.serving.fleet.config import FleetConfig
from dist_infer.serving.fleet.control_loop import ControlLoop
from dist_infer.serving.fleet.fleet_state import FleetState
from dist_infer.serving.fleet.instance_record import InstanceClient
from dist_infer.serving.fleet.instance_specs import InstancesError, TooManyRanks, parse_instances
from dist_infer.serving.fleet.instance_starter import InstanceStarter
from dist_infer.serving.fleet.interface import AdminError
from dist_infer.serving.fleet.wire import InstanceState
from dist_infer.serving.migration.control import MigrationControl
from dist_infer.serving.migration.live_migration import MODES

STOPPED_OR_DEAD = (InstanceState.DEAD, InstanceState.STOPPED)  # what an operator may start again


class AdminOps:
    def __init__(
        self,
        fleet: FleetState,
        control: ControlLoop,
        starter: InstanceStarter,
        migration: MigrationControl,
        config: FleetConfig,
    ):
        self.fleet, self.control, self.starter, self.migration = fleet, control, starter, migration
        self.max_instances = config.max_instances

    def describe_instances(self) -> list[dict]:
        with self.fleet.lock:
            moving = {r: rec.moving for r, rec in self.fleet.requests.items() if rec.moving is not None}
            owner = {r: rec.owner for r, rec in self.fleet.requests.items() if rec.owner is not None}
        out = []
        for c in self.fleet.instances:
            d = c.describe()
            d["requests"] = [r for r, i in owner.items() if i == c.index]  # the API's routing: up to date
            d["migrating"] = [r for r, (s, t) in moving.items() if c.index in (s, t)]
            out.append(d)
        return out

    def _instance(self, index: int) -> InstanceClient:
        instances = self.fleet.instances
        if not 0 <= index < len(instances):
            raise AdminError(404, f"instance {index} does not exist (there are {len(instances)})")
        return instances[index]

    def migrate_now(self, request_id: str, to_instance: int, mode: str = "live") -> concurrent.futures.Future:
        """Force one migration (operators, tests, benchmarks); the future gives its MigrationResult."""
        instances = self.fleet.instances
        if mode not in MODES:
            raise AdminError(400, f"mode {mode!r} is not one of {MODES}")
        if not 0 <= to_instance < len(instances):
            raise AdminError(400, f"to_instance {to_instance} is not one of the {len(instances)} instances")
        with self.fleet.lock:
            rec = self.fleet.requests.get(request_id)
            src = rec.owner if rec is not None else None
            moving = rec is not None and rec.moving is not None
        if src is None:
            raise AdminError(404, f"request {request_id!r} is not running or waiting on any instance")
        if moving:
            raise AdminError(409, f"request {request_id!r} is already migrating")
        if src == to_instance:
            raise AdminError(400, f"request {request_id!r} is already on instance {to_instance}")
        dst = instances[to_instance]
        if not dst.accepting:
            raise AdminError(
                409, f"instance {to_instance} takes no requests ({dst.state}{', draining' if dst.draining else ''})"
            )
        if not instances[src].alive:
            raise AdminError(409, f"request {request_id!r} is on instance {src}, which is {instances[src].state}")
        return self.control.submit(self.migration.migrate(request_id, src, to_instance, "manual", mode))

    def drain(self, index: int) -> dict:
        """Stop dispatching to an instance and move everything on it elsewhere."""
        client = self._instance(index)
        if not client.alive:
            raise AdminError(409, f"instance {index} is {client.state}")
        others = [c for c in self.fleet.instances if c.index != index and c.accepting]
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
        self.starter.check_can_spawn()
        budget = self.starter.rank_budget()
        with self.fleet.lock:
            if client.state not in STOPPED_OR_DEAD:
                raise AdminError(409, f"instance {index} is {client.state}; it is being restarted already")
            self.starter.claim_ranks(budget, f"layout {client.spec.describe()}", client.spec.size, client)
            client.state = InstanceState.STARTING
        return self.starter.spawn(client, client.spec, "restart")

    def add_instance(self, layout: str) -> dict:
        """Scale up: start one more instance of `layout` (like one --instances item, e.g. tp=1 or
        decode:tp=2), if its ranks fit the rank budget beside those running."""
        self.starter.check_can_spawn()
        budget = self.starter.rank_budget()
        try:
            specs = parse_instances(layout, max_ranks=budget.limit if budget else None)
        except TooManyRanks as exc:  # never fits: refused before the rest of a long layout is read
            with self.fleet.lock:
                # the message with the ranks running
                self.starter.claim_ranks(budget, f"layout {layout[:80]}", exc.ranks)
            raise AdminError(400, str(exc)) from None
        except InstancesError as exc:
            raise AdminError(400, str(exc)) from None
        if len(specs) != 1:
            raise AdminError(400, f"layout {layout!r}: one instance at a time")
        with self.fleet.lock:
            instances = self.fleet.instances
            if len(instances) >= self.max_instances:
                raise AdminError(
                    409,
                    f"the server has {len(instances)} instances, --max-instances "
                    f"{self.max_instances}; restart a dead or stopped one instead",
                )
            self.starter.claim_ranks(budget, f"layout {specs[0].describe()}", specs[0].size)
            client = InstanceClient(len(instances), spec=specs[0])  # STARTING: its ranks are counted
            instances.append(client)
        return self.starter.spawn(client, specs[0], "scale-up")

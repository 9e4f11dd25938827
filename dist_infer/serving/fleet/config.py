"""How the front end runs its fleet: the serve command's fleet flags (--max-queue, --dispatch,
--migrate-interval, ...) in one place, so the parts of the fleet read the values they need from
one object instead of a constructor of fifteen keywords."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class FleetConfig:
    max_queue: int = 1024  # requests the front end holds without an instance running them (--max-queue)
    dispatch: str = "prefix"  # serving/fleet/dispatch.py's policy (--dispatch)
    migrate_interval: float = 1.0  # seconds between the controller's rebalancing rounds; 0: never (--migrate-interval)
    migration_timeout: float = 30.0  # a migration call unanswered this long has failed (--migration-timeout)
    cooldown_s: Optional[float] = None  # a request that moved stays put this long (None: from migrate_interval)
    join_timeout_s: float = 300.0  # a started instance that has not joined within this long failed to start
    max_request_failovers: int = 1  # a request whose instances died more often fails (--max-request-failovers)
    max_instances: int = 16  # instances the server may have, dead and stopped ones included (--max-instances)
    auto_restart: bool = False  # a dead instance is started again, placed anew by the spawner (--auto-restart)
    kv_mirror: str = "off"  # "buddy": running requests' KV blocks are mirrored to a buddy instance (--kv-mirror)
    kv_mirror_fraction: float = 0.5  # the share of a buddy's KV blocks mirrors may hold (--kv-mirror-fraction)

    @property
    def cooldown(self) -> float:
        """How long a request stays where it moved before the controller may move it again."""
        return self.cooldown_s if self.cooldown_s is not None else max(2.0, 5 * self.migrate_interval)

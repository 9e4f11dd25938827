"""Instances placed by Ray (`serve --placement ray`): each instance a placement group of one bundle
per rank, packed on one node (STRICT_PACK), wherever the cluster has room; an actor on the group's
first bundle runs the instance's job there (our launcher and its ranks, `serve --join`, as the local
spawner runs it) and dies with its node. The front end stays where `serve` was started.

What the cluster sees of an instance is a `RayInstanceJob`, a subprocess.Popen look-alike (poll,
wait, terminate, kill) with the Ray node id it landed on: restart, scale-up and the autoscaler go
through the same spawner, so each lands wherever Ray finds room. When a node dies, its actors and
the jobs they own die with it (the launcher and its ranks die with their parent), the instance's
connection drops, and the cluster's failover moves its requests on (serving/fleet/lifecycle.py).

Ray is optional (`pip install 'dist_infer[ray]'`); nothing else imports this module.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
from typing import Optional

from loguru import logger

from dist_infer.serving.placement.rank_budget import RankBudget, ray_capacity
from dist_infer.serving.placement.spawn import HUB_FILE_ENV, HUB_KEY_ENV, instance_argv
from dist_infer.topology.discovery import without_launcher_env

NAMESPACE = "dist-infer"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps a loopback address (ray_constants)


class PlacementError(RuntimeError):
    """Ray could not place an instance (no node with room within the timeout, Ray not installed)."""


def _host_of(address: str) -> str:
    """The host of a Ray address: HOST:PORT, [V6]:PORT, ray://HOST:PORT, or a bare host."""
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    return rest if rest.count(":") > 1 else rest.split(":", 1)[0]


def keep_ray_on_loopback(address: str) -> None:
    """For a cluster at a loopback address, tell Ray to stay on the loopback: it would otherwise
    swap 127.0.0.1 for the host's outward address, which the nodes do not listen on, and the driver
    hangs. Ray reads the variable once, when it is imported, so this must run before the first
    `import ray` of the process; a value the user set is kept."""
    if _host_of(address) not in LOOPBACK:
        return
    if "ray" in sys.modules and RAY_CLUSTER_ENV not in os.environ:
        logger.warning(
            f"Ray was imported before --ray-address {address} was seen: if the driver hangs, export {RAY_CLUSTER_ENV}=0"
        )
    os.environ.setdefault(RAY_CLUSTER_ENV, "0")


def connect(address: str) -> None:
    """Join the Ray cluster at `address` ('auto': the one this host runs) as a driver. A cluster
    whose nodes all listen on the loopback stays there (keep_ray_on_loopback)."""
    keep_ray_on_loopback(address)
    try:
        import ray
    except ImportError:
        raise PlacementError("--placement ray needs Ray: pip install 'dist_infer[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    logger.info(f"placing instances with Ray ({address}): {len(ray.nodes())} node(s)")


def _runner_class():
    """The actor that owns an instance's job on its node (defined lazily: Ray is optional)."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class InstanceRunner:
        def start(self, command: list, env: dict) -> str:
            from dist_infer.topology.processes import die_with_parent

            self.process = subprocess.Popen(command, env=env, preexec_fn=die_with_parent)
            return ray.get_runtime_context().get_node_id()

        def poll(self) -> Optional[int]:
            return self.process.poll()

        def wait(self, timeout: float) -> Optional[int]:
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                return None

        def signal(self, kill: bool) -> None:
            if self.process.poll() is None:
                (self.process.kill if kill else self.process.terminate)()

    return InstanceRunner


class RayInstanceJob:
    """An instance's job under Ray, as the cluster handles a local job's Popen."""

    def __init__(self, runner, group, node: str, index: int):
        self.runner, self.group, self.node, self.index = runner, group, node, index
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._call("poll", timeout=10.0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        while (code := self.poll()) is None:
            left = deadline - time.monotonic()
            if timeout is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"instance {self.index} on Ray node {self.node}", timeout)
            self._call("wait", min(1.0, left), timeout=30.0)
        return code

    def terminate(self) -> None:
        self._call("signal", False, timeout=10.0)

    def kill(self) -> None:
        """Kill the job and give its node's resources back."""
        import ray
        from ray.util import remove_placement_group

        self._call("signal", True, timeout=10.0)
        try:
            ray.kill(self.runner)
            remove_placement_group(self.group)
        except Exception as exc:  # noqa: BLE001 - a node already gone took them with it
            logger.debug(f"instance {self.index}: releasing its Ray placement: {exc!r}")

    def _call(self, method: str, *args, timeout: float):
        """The runner's answer; a dead runner (its node died, or it was killed) reads as a job killed
        by SIGKILL (-9), as Popen reports a job killed that way."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(getattr(self.runner, method).remote(*args), timeout=timeout)
        except RayActorError:
            if method in ("poll", "wait"):
                self.returncode = -9
            return -9 if method in ("poll", "wait") else None
        except GetTimeoutError:
            return None


class RaySpawner:
    """spawn(index, spec) -> RayInstanceJob: instance `index` placed as a packed placement group of
    spec.size bundles ({CPU: cpus_per_rank, GPU: gpus_per_rank} each), its job started on that node."""

    CAPACITY_TTL_S = 1.0  # the cluster's resources are asked at most this often (describe and the autoscaler ask too)

    def __init__(
        self,
        argv: list[str],
        hub: tuple,
        key: bytes,
        cpus_per_rank: int = 1,
        gpus_per_rank: int = 0,
        place_timeout_s: float = 60.0,
    ):
        self.argv, self.hub, self.key = argv, hub, key
        self.cpus_per_rank, self.gpus_per_rank, self.place_timeout_s = cpus_per_rank, gpus_per_rank, place_timeout_s
        self.runner_class = _runner_class()
        self._capacity: Optional[tuple[float, RankBudget]] = None

    def __call__(self, index: int, spec) -> RayInstanceJob:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": float(self.cpus_per_rank)}
        if self.gpus_per_rank:
            bundle["GPU"] = float(self.gpus_per_rank)
        group = placement_group(
            [dict(bundle) for _ in range(spec.size)],
            strategy="STRICT_PACK",
            name=f"dist-infer-instance-{index}-{os.getpid()}-{time.monotonic_ns()}",
        )
        try:
            ray.get(group.ready(), timeout=self.place_timeout_s)
        except Exception as exc:  # noqa: BLE001 - GetTimeoutError, or the group was removed
            ray.util.remove_placement_group(group)
            raise PlacementError(
                f"instance {index} ({spec.describe()}): no Ray node had {spec.size} x {bundle} "
                f"free within {self.place_timeout_s:g} s ({exc.__class__.__name__})"
            ) from None
        runner = self.runner_class.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        ).remote()
        command = [sys.executable, "-m", "dist_infer", *instance_argv(self.argv, index, spec, self.hub)]
        env = without_launcher_env(os.environ)
        env[HUB_KEY_ENV] = self.key.decode()
        env.pop(HUB_FILE_ENV, None)
        env["OMP_NUM_THREADS"] = str(max(1, self.cpus_per_rank))  # the cores Ray reserved for each rank
        node = ray.get(runner.start.remote(command, env), timeout=self.place_timeout_s)
        logger.info(f"instance {index} ({spec.describe()}) placed on Ray node {node[:12]}: {' '.join(command)}")
        return RayInstanceJob(runner, group, node, index)

    def rank_capacity(self) -> RankBudget:
        """The ranks the Ray cluster holds now (its CPUs, or GPUs, over what a rank reserves): asked
        anew every CAPACITY_TTL_S, since nodes join and leave."""
        import ray

        now = time.monotonic()
        if self._capacity is None or now - self._capacity[0] > self.CAPACITY_TTL_S:
            try:
                resources = ray.cluster_resources()
            except Exception as exc:  # noqa: BLE001 - the GCS did not answer: the last answer stands
                if self._capacity is None:
                    raise
                logger.warning(f"Ray's cluster resources: {exc!r}; the rank budget stays {self._capacity[1].limit}")
                self._capacity = (now, self._capacity[1])  # asked again after the TTL, not at every start
            else:
                self._capacity = (now, ray_capacity(resources, self.cpus_per_rank, self.gpus_per_rank))
        return self._capacity[1]

"""What every rank-side command does first (join the job, build the groups) and last (exit so
that one failing rank ends the whole job instead of leaving the others waiting)."""

from __future__ import annotations

import os
import sys
import traceback
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

from loguru import logger

from dist_infer.launch.logs import configure_logging
from dist_infer.topology import Layout, LayoutError, Mesh, discover

if TYPE_CHECKING:
    from dist_infer.comm import ParallelGroups

T = TypeVar("T")


def join_world(backend: str, timeout: float, iface, log_level: str, check: Callable[[int], T]):
    """Join the job's world communicator -> (world, rank info, check(world size)). `check`
    validates the layout before any rendezvous, so a bad one is a clear error, not a hang."""
    from dist_infer.comm import discover_rank, init_world  # torch: on the ranks, not in a launcher

    info = discover_rank(backend)
    configure_logging(f"rank {info.rank}/{info.world_size}", log_level)
    checked = check(info.world_size)
    return init_world(backend, timeout=timeout, iface=iface, info=info), info, checked


def join_job(
    backend: str, config: Layout, timeout: float, iface=None, log_level: str = "INFO", shm: str = "auto"
) -> ParallelGroups:
    from dist_infer.comm import build_groups

    world, info, mesh = join_world(backend, timeout, iface, log_level, check=lambda n: Mesh.build(config, n))
    if info.rank == 0:
        logger.info(f"{info.world_size} ranks via {info.launcher}, backend {world.backend}, mesh {mesh.describe()}")
    mesh.warn_about_layout(info.local_world_size)
    return build_groups(world, mesh, shm)


def _abort_mpi(code: int) -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
        mpi.COMM_WORLD.Abort(code)  # MPI_Finalize would wait for the ranks we are abandoning


def run_rank_command(body: Callable[[], int]) -> int:
    """Run a rank-side command; on any error log it with the rank and end the process now."""
    logger.enable("dist_infer")  # a rank program reports its errors, whatever set up (or not) its logging
    try:
        code = body()
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # noqa: BLE001 - the point is to never leave peers hanging
        logger.error(f"{type(exc).__name__}: {exc}")
        logger.debug(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code != 0:
        _abort_mpi(code)
        os._exit(code)  # skip interpreter teardown that may block on peers
    return code


def world_needed(args) -> int:
    if getattr(args, "instances", None):
        from dist_infer.serving.fleet.instance_specs import parse_instances

        # a serving instance's job (--join) is one instance: its ep and cp multiply its tp x pp
        return sum(s.size for s in parse_instances(args.instances, args.tp, args.pp)) * args.ep * args.cp
    return args.tp * args.pp * args.ep * args.cp


def spawn_local(args, argv: list[str]) -> Optional[int]:
    """Outside any launcher, start the ranks ourselves; returns the exit code, or None to run in-process."""
    if discover(os.environ) is not None:
        return None
    n = args.nproc or world_needed(args)
    if n == 1:
        return None
    from dist_infer.launch.launcher import relaunch_as_local_ranks
    from dist_infer.models.builtin import resolve_model

    configure_logging("launch")
    if not getattr(args, "instances", None):
        try:  # the ranks would each find this out after starting (and importing torch): say it once, now
            Mesh.build(Layout(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp), n)
        except LayoutError as exc:
            logger.error(f"{exc}; no rank was started (--nproc {n})")
            return 2
    if hasattr(args, "model"):
        resolve_model(args.model)  # once, before the ranks race to write `tiny` (and a clear error if missing)
    return relaunch_as_local_ranks(argv, n)

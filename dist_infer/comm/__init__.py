"""One communicator interface over torch.distributed (NCCL, gloo) and MPI; every op also async."""

from dist_infer.comm.base import (
    DEFAULT_TIMEOUT_S,
    REDUCE_OPS,
    CommError,
    CommTimeoutError,
    Communicator,
    Handle,
    P2POp,
)
from dist_infer.comm.groups import ParallelGroups, build_groups
from dist_infer.comm.init import BACKENDS, BackendError, discover_rank, init_world

__all__ = [
    "BACKENDS", "DEFAULT_TIMEOUT_S", "REDUCE_OPS", "BackendError", "CommError", "CommTimeoutError",
    "Communicator", "Handle", "P2POp", "ParallelGroups", "build_groups", "discover_rank", "init_world",
]

"""One communicator interface over torch.distributed (NCCL, gloo) and MPI; every op also async.

The names below are imported on first use (PEP 562), so `dist_infer.comm.backends` (what the
command line needs) loads without torch: a launcher that only starts ranks skips torch's import."""

from importlib import import_module

_WHERE = {
    "BACKENDS": "backends",
    "DEFAULT_TIMEOUT_S": "backends",
    "REDUCE_OPS": "base",
    "CommError": "base",
    "CommTimeoutError": "base",
    "Communicator": "base",
    "Handle": "base",
    "P2POp": "base",
    "ParallelGroups": "groups",
    "build_groups": "groups",
    "BackendError": "init",
    "discover_rank": "init",
    "init_world": "init",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"dist_infer.comm.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dist_infer.comm' has no attribute {name!r}")

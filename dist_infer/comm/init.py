"""Joining the job: discover the rank, rendezvous, return the world communicator."""

from __future__ import annotations

import atexit
import datetime
import ipaddress
import os
import socket
from typing import Optional

import torch
from loguru import logger

from dist_infer.comm.backends import BACKENDS, DEFAULT_TIMEOUT_S
from dist_infer.comm.base import Communicator
from dist_infer.topology.discovery import RankInfo, discover, free_port, needs_mpi, resolve_with_mpi
from dist_infer.topology.network import set_socket_interface

_LISTENERS: list[socket.socket] = []  # rendezvous sockets of this process (a job's rank 0 has one)


class BackendError(RuntimeError):
    """A backend that cannot run here (nccl without CUDA, mpi without mpi4py)."""


def _mpi_launched(env) -> bool:
    return any(k in env for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"))


def torch_backend_string(backend: str) -> str:
    if backend == "gloo":
        return "gloo"
    cuda = torch.cuda.is_available()
    if backend == "nccl":
        if not cuda:
            raise BackendError("--backend nccl needs CUDA, and torch sees no GPU here; use gloo or mpi")
        return "cpu:gloo,cuda:nccl"
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def discover_rank(backend: str = "auto", env=None) -> RankInfo:
    """This process's RankInfo, asking MPI for whatever the launcher left out."""
    env = os.environ if env is None else env
    info = discover(env)
    if backend == "mpi" or needs_mpi(info) or (info is None and _mpi_launched(env)):
        info = resolve_with_mpi(info)
    if info is None:
        info = RankInfo(0, 1, 0, 1, 0, "127.0.0.1", free_port(), "single")
    return info


def init_world(
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT_S,
    iface: Optional[str] = None,
    info: Optional[RankInfo] = None,
) -> Communicator:
    """Initialise `backend` for this process and return the world communicator."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    info = info or discover_rank(backend)
    if backend == "mpi":
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise BackendError("--backend mpi needs mpi4py (pip install 'dist_infer[mpi]' mpi4py)") from exc
        from dist_infer.comm.mpi_backend import MPICommunicator

        return MPICommunicator(MPI.COMM_WORLD, timeout=timeout)

    import torch.distributed as dist

    tb = torch_backend_string(backend)
    if info.num_nodes > 1 or iface:
        chosen = set_socket_interface(os.environ, info.master_addr, iface)
        logger.debug(f"socket interface for {tb}: {chosen}")
    if info.master_port is None:
        raise BackendError(f"{info.launcher} launch without MASTER_PORT; set MASTER_ADDR and MASTER_PORT")
    if torch.cuda.is_available() and "nccl" in tb:
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=tb,
        store=rendezvous_store(info, timeout),
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    atexit.unregister(_destroy_at_exit)  # one hook, however often a process joins
    atexit.register(_destroy_at_exit)
    from dist_infer.comm.torch_backend import TorchDistCommunicator

    return TorchDistCommunicator(None, list(range(info.world_size)), "world", timeout)


def store_address(master_addr: str) -> str:
    """The IP the rendezvous store listens on and ranks dial: MASTER_ADDR resolved (IPv4 first)."""
    try:
        found = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise BackendError(f"MASTER_ADDR {master_addr!r} does not resolve: {exc}") from None
    found.sort(key=lambda entry: entry[0] != socket.AF_INET)
    return str(found[0][4][0])  # (the address of a sockaddr: a str)


def rendezvous_store(info: RankInfo, timeout: float):
    """The job's TCPStore. torch's tcp:// rendezvous listens on every interface, so anyone on any
    network the master host is on could talk to it; rank 0 listens on MASTER_ADDR's own address
    instead, and the other ranks connect there. A one-process world needs no store server: serving
    starts its one-rank instances side by side, and each taking a "free" port for a store of its
    own raced a launcher that had just picked the same port for its job."""
    from torch.distributed import HashStore, PrefixStore, TCPStore

    if info.world_size == 1:  # nobody to meet: no listener at all, and no port to race other jobs for
        return HashStore()
    if info.master_addr is None or info.master_port is None:
        raise BackendError(
            f"{info.launcher} launch without MASTER_ADDR or MASTER_PORT; set MASTER_ADDR and MASTER_PORT"
        )
    host = store_address(info.master_addr)
    limit = datetime.timedelta(seconds=timeout)
    # under torchrun its agent already serves the store on MASTER_PORT: every rank is a client
    if info.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = TCPStore(host, info.master_port, info.world_size, is_master=False, timeout=limit)
        return PrefixStore("default_pg", store)  # the keys tcp:// would use, clear of the agent's
    if info.num_nodes > 1 and ipaddress.ip_address(host).is_loopback:
        raise BackendError(
            f"MASTER_ADDR {info.master_addr!r} is {host} on this host, which the other hosts cannot "
            f"reach, and the rendezvous never listens on every interface: set MASTER_ADDR to this "
            f"host's address on the job's network"
        )
    bind = host
    listener = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((bind, info.master_port))
        listener.listen(1024)
    except OSError as exc:
        listener.close()
        raise BackendError(f"the rendezvous cannot listen on {bind}:{info.master_port}: {exc}") from None
    _LISTENERS.append(listener)  # the store serves on this fd: it must outlive the store
    logger.debug(f"rendezvous store listening on {bind}:{info.master_port}")
    store = TCPStore(
        host,
        info.master_port,
        info.world_size,
        is_master=True,
        timeout=limit,
        master_listen_fd=listener.fileno(),
        use_libuv=True,
    )
    return PrefixStore("default_pg", store)


def _destroy_at_exit() -> None:
    """Tear the process group down before the interpreter does: a gloo group left to C++
    destructors at shutdown can abort the process ('terminate called without an active
    exception') after all the work succeeded."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass

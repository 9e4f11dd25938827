"""Where every rank is: discovery from launchers, hostfiles, the mesh of parallel groups."""

from dist_infer.topology.discovery import (
    DiscoveryError,
    RankInfo,
    discover,
    expand_slurm_nodelist,
    free_port,
    needs_mpi,
    resolve_with_mpi,
    single_process,
)
from dist_infer.topology.hostfile import Host, HostfileError, node_rank_offsets, parse_hostfile, parse_hostfile_text
from dist_infer.topology.mesh import AXES, Mesh, ParallelConfig, ParallelConfigError
from dist_infer.topology.network import interface_towards, set_socket_interface

__all__ = [
    "AXES", "DiscoveryError", "Host", "HostfileError", "Mesh", "ParallelConfig", "ParallelConfigError",
    "RankInfo", "discover", "expand_slurm_nodelist", "free_port", "interface_towards", "needs_mpi",
    "node_rank_offsets", "parse_hostfile", "parse_hostfile_text", "resolve_with_mpi", "set_socket_interface",
    "single_process",
]

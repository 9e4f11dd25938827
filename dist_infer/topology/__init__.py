"""Where every rank is: discovery from launchers, hostfiles, the layout and the mesh of parallel groups;
and the host's processes as every layer above sees them: its usable cores and each local rank's share
(`cores`), stopping child process groups and ending this process without teardown (`processes`), and
another `dist-infer` command run as a child job, its `--json` read back (`subcommand`). No torch."""

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
from dist_infer.topology.layout import DISPLAY_ORDER, Layout, LayoutError, parse_layout
from dist_infer.topology.mesh import RANK_ORDER, Mesh
from dist_infer.topology.network import interface_towards, set_socket_interface

__all__ = [
    "DISPLAY_ORDER",
    "DiscoveryError",
    "Host",
    "HostfileError",
    "Layout",
    "LayoutError",
    "Mesh",
    "RANK_ORDER",
    "RankInfo",
    "discover",
    "expand_slurm_nodelist",
    "free_port",
    "interface_towards",
    "needs_mpi",
    "node_rank_offsets",
    "parse_hostfile",
    "parse_hostfile_text",
    "parse_layout",
    "resolve_with_mpi",
    "set_socket_interface",
    "single_process",
]

"""Which network interface reaches the other hosts.

gloo and NCCL pick an interface by themselves and on multi-homed nodes often pick one that
cannot reach the master (docker0, a management NIC): the classic multi-node hang. We name the
interface whose address routes to the master address, unless the user named one.
"""

from __future__ import annotations

import socket
from typing import Mapping, MutableMapping, Optional


def local_address_towards(host: str) -> str:
    """The address of this machine on the interface that routes to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def own_address() -> str:
    """This host's address others can reach: the hostname's resolution unless it is loopback."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = "127.0.0.1"
    if addr.startswith("127."):
        others = [a for name, a in interface_addresses().items() if not a.startswith("127.")]
        addr = others[0] if others else addr
    return addr


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one, by interface name."""
    import psutil

    out: dict[str, str] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET:
                out[name] = a.address
                break
    return out


def interface_for_address(address: str, addresses: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The interface that holds `address`, or None."""
    addresses = interface_addresses() if addresses is None else addresses
    for name, addr in addresses.items():
        if addr == address:
            return name
    return None


def interface_towards(master_addr: str) -> Optional[str]:
    """The interface the kernel would use to reach `master_addr`."""
    try:
        target = socket.gethostbyname(master_addr)
    except OSError:
        return None
    return interface_for_address(local_address_towards(target))


def set_socket_interface(
    env: MutableMapping[str, str], master_addr: Optional[str], iface: Optional[str] = None
) -> Optional[str]:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME for a multi-host job; returns the name used.

    An explicit `iface` wins; variables the user already exported are left alone.
    """
    if iface is None:
        if "GLOO_SOCKET_IFNAME" in env and "NCCL_SOCKET_IFNAME" in env:
            return env["GLOO_SOCKET_IFNAME"]
        if not master_addr:
            return None
        iface = interface_towards(master_addr)
        if iface is None:
            return None
        env.setdefault("GLOO_SOCKET_IFNAME", iface)
        env.setdefault("NCCL_SOCKET_IFNAME", iface)
        return env["GLOO_SOCKET_IFNAME"]
    env["GLOO_SOCKET_IFNAME"] = iface
    env["NCCL_SOCKET_IFNAME"] = iface
    return iface


__all__ = ["interface_addresses", "interface_for_address", "interface_towards", "set_socket_interface"]

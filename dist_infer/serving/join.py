"""An instance's side of joining the front end: where the hub is, the driver's connection to it,
and every rank's KV link for migrations.

The instance's first rank (its driver) connects to the front end's hub, says hello and runs the
step loop as it is told (serving/instance_server.py); the other ranks follow its step plans.
Every rank listens on its own KV link (comm/peer_link.py), authenticated with the cluster key, so
after start-up no instance waits on another's ranks. A job started with `serve --join HOST:PORT`
reads the hub from its flags and the key from $DIST_INFER_HUB_KEY (or a key file); in a launched
job, world rank 0 tells every rank where the hub is (`share_hub_address`, a collective).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from dist_infer.serving.spawn import HUB_KEY_ENV

HUB_CONNECT_TRIES = 6


def hub_to_join(join: Optional[str], key_file: Optional[str]) -> tuple[tuple, bytes]:
    """--join HOST:PORT and the key (from $DIST_INFER_HUB_KEY, else --hub-key-file) -> (address, key)."""
    host, _, port = (join or "").rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [IPv6]:PORT
    if not host or not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"--join {join!r}: expected HOST:PORT with a port in 1..65535 (the hub address the server logs)")
    key = os.environ.get(HUB_KEY_ENV)
    if not key and key_file:
        key = Path(key_file).read_text().strip()
    if not key:
        raise ValueError(f"--join: the hub's key is neither in ${HUB_KEY_ENV} nor in a --hub-key-file")
    return (host, int(port)), key.encode()


def share_hub_address(world, address: Optional[tuple], key: Optional[bytes]) -> tuple[tuple, bytes]:
    """World rank 0's API address and connection key, to every rank (a collective)."""
    import torch

    buf = torch.zeros(512, dtype=torch.uint8)
    if address is not None:
        raw = json.dumps({"host": address[0], "port": address[1], "key": key.decode()}).encode()
        buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    if world.size > 1:
        world.broadcast(buf, 0)
    info = json.loads(bytes(buf[buf != 0].tolist()).decode())
    return (info["host"], info["port"]), info["key"].encode()


def hub_host() -> str:
    """The address the instances' drivers reach world rank 0 at: the one facing the rendezvous host."""
    from dist_infer.topology.network import local_address_towards

    master = os.environ.get("MASTER_ADDR")
    if not master or master in ("localhost", "127.0.0.1"):
        return "127.0.0.1"
    return local_address_towards(master)


def open_kv_link(engine, groups, hub_host: str, key: bytes, cp: int, timeout: float):
    """Every rank: listen for migrating KV blocks on the address facing the API's host, learn the
    instance's other ranks' addresses (a collective over the instance), and take part in
    migrations. -> (the link, every rank's address); (None, []) for context-parallel instances."""
    import torch

    from dist_infer.comm.peer_link import PeerLink
    from dist_infer.engine.kv_transfer import int_to_ip, ip_to_int
    from dist_infer.topology.network import local_address_towards

    if cp > 1:
        return None, []
    host = "127.0.0.1" if hub_host in ("127.0.0.1", "localhost") else local_address_towards(hub_host)
    link = PeerLink(host, timeout=timeout, key=key)
    mine = torch.tensor([ip_to_int(link.address[0]), link.address[1]], dtype=torch.long)
    every = torch.empty(2 * groups.world.size, dtype=torch.long)
    groups.world.all_gather(every, mine)
    v = every.tolist()
    addresses = [(int_to_ip(v[2 * r]), v[2 * r + 1]) for r in range(groups.world.size)]
    engine.enable_migration(link, addresses)
    return link, addresses


def block_bytes(stage, block_size: int) -> int:
    """Bytes of one KV block over the whole model (all layers, all KV heads): what a migration moves."""
    import torch

    cfg = stage.cfg
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=stage.dtype).element_size()


def run_instance(engine, index: int, address: tuple, key: bytes, hello) -> None:
    """The driver: connect to the hub (retrying while its handshake slots are taken), say hello, and
    serve the front end's calls until it stops the instance."""
    from multiprocessing.connection import Client

    from dist_infer.serving.hub import no_delay
    from dist_infer.serving.instance_server import InstanceServer

    for attempt in range(HUB_CONNECT_TRIES):  # a hub whose handshake slots are all taken closes at accept
        try:
            conn = Client(address, authkey=key)
            break
        except (OSError, EOFError) as exc:
            if attempt == HUB_CONNECT_TRIES - 1:
                raise ConnectionError(f"instance {index}: could not join the API's hub at {address[0]}:{address[1]} "
                                      f"in {HUB_CONNECT_TRIES} tries ({type(exc).__name__}: {exc})") from None
            time.sleep(0.5 * (attempt + 1))
    InstanceServer(engine, index, no_delay(conn)).run(hello)

"""An instance's side of joining the front end: where the hub is, the driver's connection to it,
and every rank's KV link for migrations.

The instance's first rank (its driver) connects to the front end's hub, says hello and runs the
step loop as it is told (serving/instance/driver_loop.py); the other ranks follow its step plans.
Every rank listens on its own KV link (comm/peer/link.py), authenticated with the cluster key, so
after start-up no instance waits on another's ranks. A job started with `serve --join HOST:PORT`
reads the hub from its flags and the key from $DIST_INFER_HUB_KEY (or a key file); in a launched
job, world rank 0 tells every rank where the hub is (`share_hub_address`, a collective).
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Callable, Optional

from loguru import logger

from dist_infer.serving.fleet.hub import set_io_timeout
from dist_infer.serving.placement.spawn import HUB_KEY_ENV


@dataclass(frozen=True)
class JoinRetry:
    """How a driver keeps trying to join the hub: a hub under a flood of strangers' connections
    (or with every handshake slot taken) makes a join wait or closes it, so the driver retries
    with exponential back-off and jitter (pauses of first_s, doubling, at most max_s, each
    drawn in its upper half) for up to budget_s in all. One try may wait attempt_s: a hub
    that parks a connection (serving/fleet/hub_admission.py) lets it in, in arrival order."""

    budget_s: float = 60.0
    first_s: float = 0.1
    max_s: float = 5.0
    attempt_s: float = 40.0


def retry_pause(tries: int, retry: JoinRetry, rng: random.Random) -> float:
    """The pause after `tries` failed tries (1, 2, ...): "equal jitter", in [cap/2, cap] with cap
    = first_s * 2**(tries-1) up to max_s, so drivers restarted together do not retry in step."""
    cap = min(retry.max_s, retry.first_s * 2 ** min(tries - 1, 30))
    return cap / 2 + rng.uniform(0, cap / 2)


def dial_hub(address: tuple, key: bytes, timeout: float) -> Connection:
    """One try: connect and run multiprocessing's key challenge both ways (as its Client does),
    each connect, read and write bounded by `timeout` (Client's own would wait for ever)."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        set_io_timeout(conn, timeout)
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
        set_io_timeout(conn, 0)
    except BlockingIOError:  # what a read or write past SO_RCVTIMEO / SO_SNDTIMEO raises
        conn.close()
        raise TimeoutError(f"the hub did not finish the key challenge within {timeout:g} s") from None
    except BaseException:
        conn.close()
        raise
    return conn


def join_hub(
    address: tuple,
    key: bytes,
    index: int,
    retry: JoinRetry = JoinRetry(),
    dial: Callable[[tuple, bytes, float], Connection] = dial_hub,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    rng: Optional[random.Random] = None,
) -> Connection:
    """The driver's authenticated connection to the hub, retried (JoinRetry) while the hub is
    unreachable, busy or closes the try; ConnectionError saying how long it tried and why the
    last try failed. A hub that does not hold the key (AuthenticationError) is not retried."""
    rng = rng or random.Random()
    where = f"{address[0]}:{address[1]}"
    began = clock()
    tries = 0
    while True:
        left = retry.budget_s - (clock() - began)
        try:
            return dial(address, key, max(1.0, min(retry.attempt_s, left)))
        except (OSError, EOFError) as exc:
            tries += 1
            last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        pause = retry_pause(tries, retry, rng)
        spent = clock() - began
        if spent + pause >= retry.budget_s:
            raise ConnectionError(
                f"instance {index}: could not join the API's hub at {where} in {spent:.1f} s "
                f"({tries} tries, up to {retry.budget_s:g} s); the last failed with {last}"
            ) from None
        logger.info(f"instance {index}: joining the hub at {where} failed ({last}); trying again in {pause:.2f} s")
        sleep(pause)


def hub_to_join(join: Optional[str], key_file: Optional[str]) -> tuple[tuple, bytes]:
    """--join HOST:PORT and the key (from $DIST_INFER_HUB_KEY, else --hub-key-file) -> (address, key)."""
    host, _, port = (join or "").rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [IPv6]:PORT
    if not host or not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(
            f"--join {join!r}: expected HOST:PORT with a port in 1..65535 (the hub address the server logs)"
        )
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
        if key is None:
            raise ValueError("share_hub_address: the hub's address comes with its key")
        raw = json.dumps({"host": address[0], "port": address[1], "key": key.decode()}).encode()
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
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

    from dist_infer.comm.peer.link import PeerLink
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
    return (
        cfg.num_layers
        * 2
        * block_size
        * cfg.num_kv_heads
        * cfg.head_dim
        * torch.empty((), dtype=stage.dtype).element_size()
    )


def run_instance(engine, index: int, address: tuple, key: bytes, hello) -> None:
    """The driver: join the hub (retried, join_hub), say hello, and serve the front end's calls
    until it stops the instance."""
    from dist_infer.serving.fleet.hub import no_delay
    from dist_infer.serving.instance.driver_loop import InstanceServer

    InstanceServer(engine, index, no_delay(join_hub(address, key, index))).run(hello)

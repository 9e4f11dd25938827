"""The front end's hub: where every instance's driver connects and says hello.

Anyone who can reach the port can connect, so no one connection may stop the hub: the accept
loop only accepts, each connection's handshake (the key challenge both ways, then the hello)
runs on a thread of its own under a deadline, at most MAX_HANDSHAKES at once, and whatever one
connection does (garbage, silence, a reset, a wrong key) is logged and that connection closed.
Connections carry multiprocessing's authenticated, pickled messages (serving/instance_server.py),
so only a holder of the cluster key ever gets as far as a pickle.
"""

from __future__ import annotations

import socket
import struct
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Callable, Optional

from loguru import logger

from dist_infer.serving.wire import Hello

HANDSHAKE_TIMEOUT_S = 10.0  # a driver that connects answers the challenge and says hello within this
MAX_HANDSHAKES = 16  # connections being checked at once; more are closed at accept
OnHello = Callable[[Connection, Hello], None]


def no_delay(conn: Connection) -> Connection:
    """Turn off Nagle's algorithm on a connection's TCP socket: the wire carries small messages
    both ways, and a small write behind an unacknowledged one otherwise waits for the peer's
    delayed ACK (40 ms on Linux), which had made every migration call take that long."""
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup of the same socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def set_io_timeout(conn: Connection, seconds: float) -> None:
    """Bound each blocking read and write on the connection's socket (0: no bound). Connection
    reads the descriptor directly, so a socket-level timeout (SO_RCVTIMEO) is what bounds it."""
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def read_hello(conn: Connection, timeout: float) -> Hello:
    """A driver's first message, its hello, checked; a clear error if it says nothing, something
    else, or a hello whose fields are wrong."""
    if not conn.poll(timeout):
        raise TimeoutError(f"an instance driver connected but said nothing for {timeout:g} s")
    message = conn.recv()
    if not isinstance(message, Hello):
        raise ValueError(f"an instance driver sent {str(message)[:80]!r} first, not its hello")
    return message.checked()


class Deadline:
    """Shuts a connection's socket down when `seconds` pass before `disarm()`: a blocked read then
    ends at once. disarm() -> False if the deadline had already struck."""

    def __init__(self, conn: Connection, seconds: float):
        self._lock = threading.Lock()
        self._state = "armed"
        self._fd = conn.fileno()
        self._timer = threading.Timer(seconds, self._strike)
        self._timer.daemon = True
        self._timer.start()

    def _strike(self) -> None:
        with self._lock:
            if self._state != "armed":
                return
            self._state = "struck"
            try:
                with socket.fromfd(self._fd, socket.AF_INET, socket.SOCK_STREAM) as dup:
                    dup.shutdown(socket.SHUT_RDWR)  # acts on the socket itself, not just the dup
            except OSError:
                pass

    def disarm(self) -> bool:
        self._timer.cancel()
        with self._lock:
            if self._state == "armed":
                self._state = "disarmed"
            return self._state == "disarmed"


class Hub:
    """Listens on (host, port 0); `start(on_hello)` hands each checked driver connection over."""

    def __init__(self, host: str, key: bytes, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_handshakes: int = MAX_HANDSHAKES):
        self.key = key
        self.handshake_timeout_s = handshake_timeout_s
        self._sock = socket.create_server((host, 0), backlog=64)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._slots = threading.BoundedSemaphore(max_handshakes)
        self._closed = threading.Event()
        self.refused = 0  # connections that failed their handshake (tests and logs)

    def start(self, on_hello: OnHello) -> None:
        threading.Thread(target=self._accept, args=(on_hello,), name="hub-accept", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self, on_hello: OnHello) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                logger.warning(f"hub: accept failed ({exc}); listening on")  # a reset before accept, fd limits
                continue
            if not self._slots.acquire(blocking=False):
                logger.warning(f"hub: {peer[0]}:{peer[1]} refused: {MAX_HANDSHAKES} handshakes already in progress")
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock, peer, on_hello), name="hub-handshake",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: tuple, on_hello: OnHello) -> None:
        conn = Connection(sock.detach())
        watchdog = Deadline(conn, self.handshake_timeout_s)  # the whole handshake, not each read: no slow drip
        try:
            set_io_timeout(conn, self.handshake_timeout_s)
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            hello = read_hello(conn, self.handshake_timeout_s)
            if not watchdog.disarm():
                raise TimeoutError(f"the handshake took over {self.handshake_timeout_s:g} s")
            set_io_timeout(conn, 0)
        except Exception as exc:  # noqa: BLE001 - that connection is refused; the hub listens on
            watchdog.disarm()
            self.refused += 1
            logger.warning(f"hub: a connection from {peer[0]}:{peer[1]} was refused ({type(exc).__name__}: {exc})")
            conn.close()
            return
        finally:
            self._slots.release()
        try:
            on_hello(no_delay(conn), hello)
        except Exception as exc:  # noqa: BLE001 - e.g. a hello with missing fields
            logger.warning(f"hub: instance {hello.index}'s hello was refused ({type(exc).__name__}: {exc})")
            conn.close()


class StartupWaiter:
    """Collects the first `count` drivers' connections (indices 0..count-1) before the API starts;
    later ones go to `later` (the cluster's attach)."""

    def __init__(self, count: int):
        self.count = count
        self.conns: dict[int, tuple[Connection, Hello]] = {}
        self.later: Optional[OnHello] = None
        self._cond = threading.Condition()

    def on_hello(self, conn: Connection, hello: Hello) -> None:
        with self._cond:
            if self.later is None:
                index = hello.index
                if not 0 <= index < self.count or index in self.conns:
                    raise ValueError(f"instance {index} is not one of the {self.count} expected, or joined twice")
                self.conns[index] = (conn, hello)
                self._cond.notify_all()
                return
        self.later(conn, hello)

    def wait(self, timeout: float, failed: Callable[[], Optional[str]] = lambda: None) -> list[tuple[Connection, Hello]]:
        """Every expected driver, in index order; TimeoutError naming the missing ones, or
        RuntimeError when `failed()` says a started instance has already exited."""
        import time

        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.conns) < self.count:
                why = failed()
                if why:
                    raise RuntimeError(why)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.count)) - set(self.conns))
                    raise TimeoutError(f"instances {missing} did not connect to the API process within {timeout:g} s")
                self._cond.wait(min(left, 0.5))
            return [self.conns[i] for i in range(self.count)]

    def hand_over(self, later: OnHello) -> None:
        with self._cond:
            self.later = later

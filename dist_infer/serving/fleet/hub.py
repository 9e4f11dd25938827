"""The front end's hub: where every instance's driver connects and says hello.

Anyone who can reach the port can connect, so no one connection may stop the hub, and no flood
of them may keep an instance out: the accept loop only accepts, and parks what may not start yet
(per-source caps and back-offs, serving/fleet/hub_admission.py); each connection's handshake (the key
challenge both ways within AUTH_TIMEOUT_S, then the hello) runs on a thread of its own under a
deadline, and whatever one connection does (garbage, silence, a reset, a wrong key) ends only
that connection, with a line in a rate-limited log (comm/rate_limited_log.py). Connections carry
multiprocessing's authenticated, pickled messages (serving/instance/driver_loop.py), so only a holder
of the cluster key ever gets as far as a pickle.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Callable, Optional, TypeVar

from loguru import logger

from dist_infer.comm.rate_limited_log import RateLimitedLog
from dist_infer.serving.fleet.hub_admission import AdmissionLimits, SourceAdmission, Verdict
from dist_infer.serving.fleet.wire import Hello

HANDSHAKE_TIMEOUT_S = 10.0  # a driver that connects answers the challenge and says hello within this
AUTH_TIMEOUT_S = 3.0  # ...and the key challenge, both ways, within this (a few round trips)
MAX_HANDSHAKES = 16  # key challenges at once; more connections wait their turn (serving/fleet/hub_admission.py)
OnHello = Callable[[Connection, Hello], None]
T = TypeVar("T")


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
    """Listens on (host, port 0); `start(on_hello)` hands each checked driver connection over.

    One thread accepts and holds the parked connections (serving/fleet/hub_admission.py decides which
    start, wait or are closed); each started handshake runs on a thread of its own. Refusals go
    to a rate-limited log: a flood writes a line a second per source and reason, not one each."""

    def __init__(
        self,
        host: str,
        key: bytes,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_handshakes: int = MAX_HANDSHAKES,
        auth_timeout_s: float = AUTH_TIMEOUT_S,
        limits: Optional[AdmissionLimits] = None,
        log: Optional[RateLimitedLog] = None,
    ):
        self.key = key
        self.handshake_timeout_s = handshake_timeout_s
        self.auth_timeout_s = min(auth_timeout_s, handshake_timeout_s)
        self._sock = socket.create_server((host, 0), backlog=128)
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._admission = SourceAdmission(limits or AdmissionLimits(max_handshakes=max_handshakes))
        self._lock = threading.Lock()  # the admission's counts: the accept thread and the handshakes'
        self._parked: dict[socket.socket, tuple[tuple, float]] = {}  # in arrival order: (peer, since)
        self._selector = selectors.DefaultSelector()
        self._wake_in, self._wake_out = socket.socketpair()  # a finished handshake wakes the accept thread
        self._wake_out.setblocking(False)
        self._log = log or RateLimitedLog()
        self._closed = threading.Event()
        self.refused = 0  # connections refused or failed in their handshake (tests and logs)

    def start(self, on_hello: OnHello) -> None:
        threading.Thread(target=self._accept, args=(on_hello,), name="hub-accept", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._wake()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _wake(self) -> None:
        try:
            self._wake_out.send(b"\0")
        except OSError:  # its buffer is full (it will wake anyway) or it is closed
            pass

    def _refuse(self, peer: tuple, reason: str, detail: str = "") -> None:
        """Count a refused connection and log it, at most a line a second per source and reason."""
        with self._lock:
            self.refused += 1
        self._log(
            ("refused", peer[0], reason),
            f"hub: refused a connection from {peer[0]}:{peer[1]} ({reason}{': ' + detail if detail else ''})",
            f"hub: refused {{count}} connections from {peer[0]} in the last {{seconds:.1f}} s ({reason})",
        )

    def _backed_off(self, source: str, seconds: float) -> None:
        if seconds:  # at most one per back-off interval and source: not rate-limited further
            logger.debug(
                f"hub: {source} failed {self._admission.limits.fail_threshold} handshakes in a row: its "
                f"connections wait {seconds:g} s before theirs start"
            )

    def _accept(self, on_hello: OnHello) -> None:
        """Accept, park, start and expire until the hub closes."""
        self._selector.register(self._sock, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_in, selectors.EVENT_READ, "wake")
        try:
            while not self._closed.is_set():
                try:
                    self._turn(on_hello)
                except Exception as exc:  # noqa: BLE001 - nothing may stop the hub taking joins
                    if self._closed.is_set():
                        return
                    self._log(
                        "loop",
                        f"hub: the accept loop failed ({type(exc).__name__}: {exc}); listening on",
                        "hub: the accept loop failed {count} more times in the last {seconds:.1f} s",
                    )
                    time.sleep(0.1)
        finally:
            for sock in self._parked:
                sock.close()
            self._parked.clear()
            self._selector.close()
            self._wake_in.close()
            self._wake_out.close()

    def _turn(self, on_hello: OnHello) -> None:
        """One wait for news: new connections, finished handshakes, parked ones hanging up."""
        for key, _ in self._selector.select(self._next_timeout()):
            if key.data == "listen":
                self._take_new(on_hello)
            elif key.data == "wake":
                self._wake_in.recv(4096)
            elif isinstance(key.fileobj, socket.socket):  # a parked connection (the only other kind registered)
                # spoke before the challenge, or hung up: not a driver
                self._unpark(key.fileobj, "spoke first or hung up while waiting", failed=True)
        self._start_parked(on_hello)
        self._log.flush()

    def _next_timeout(self) -> float:
        """Until the next parked connection may start or must go (at most a second: the log's flush)."""
        now = time.monotonic()
        oldest = next(iter(self._parked.values()), None)
        ends = [oldest[1] + self._admission.limits.max_wait_s] if oldest else []
        with self._lock:
            backoff = self._admission.next_backoff_end()
        ends += [backoff] if backoff is not None else []
        return max(0.0, min([now + 1.0] + ends) - now)

    def _take_new(self, on_hello: OnHello) -> None:
        """Accept every connection waiting in the backlog: start, park or close each."""
        for _ in range(32):  # then back to the loop: parked ones that hung up are dropped, others started
            try:
                sock, peer = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if self._closed.is_set():
                    return
                self._log(
                    "accept",
                    f"hub: accept failed ({exc}); listening on",
                    "hub: accept failed {count} more times in the last {seconds:.1f} s",
                )
                time.sleep(0.1)  # out of descriptors: it fails again until one is freed, do not spin
                return
            with self._lock:
                verdict = self._admission.arrive(peer[0])
            if verdict is Verdict.START:
                self._run(sock, peer, on_hello)
            elif verdict is Verdict.WAIT:
                self._parked[sock] = (peer, time.monotonic())
                self._selector.register(sock, selectors.EVENT_READ, "parked")
            else:
                sock.close()
                self._refuse(peer, "too many connections waiting")

    def _start_parked(self, on_hello: OnHello) -> None:
        """Start parked connections in arrival order while slots allow; close those that waited too long."""
        now = time.monotonic()
        blocked: set[str] = set()  # sources whose oldest parked connection may not start yet
        for sock, (peer, since) in list(self._parked.items()):
            if now - since > self._admission.limits.max_wait_s:
                self._unpark(sock, "waited too long for a handshake slot", failed=False)
                continue
            if peer[0] in blocked:
                continue
            with self._lock:
                go = self._admission.may_start(peer[0])
            if not go:
                blocked.add(peer[0])
                continue
            self._selector.unregister(sock)
            del self._parked[sock]
            self._run(sock, peer, on_hello)

    def _unpark(self, sock: socket.socket, reason: str, failed: bool) -> None:
        peer, _ = self._parked.pop(sock)
        self._selector.unregister(sock)
        sock.close()
        with self._lock:
            backoff = self._admission.stop_waiting(peer[0], failed)
        self._refuse(peer, reason)
        self._backed_off(peer[0], backoff)

    def _run(self, sock: socket.socket, peer: tuple, on_hello: OnHello) -> None:
        sock.setblocking(True)
        threading.Thread(target=self._handshake, args=(sock, peer, on_hello), name="hub-handshake", daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: tuple, on_hello: OnHello) -> None:
        """The key challenge both ways within auth_timeout_s (holding a slot), then the hello
        within what is left of handshake_timeout_s (the slot freed: the key is proven)."""
        began = time.monotonic()
        conn = Connection(sock.detach())

        def challenge() -> None:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)

        try:
            _bounded(conn, self.auth_timeout_s, challenge)
        except Exception as exc:  # noqa: BLE001 - that connection is refused; the hub listens on
            conn.close()
            with self._lock:
                backoff = self._admission.failed(peer[0])
            self._wake()
            self._refuse(peer, "bad handshake", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            self._backed_off(peer[0], backoff)
            return
        with self._lock:
            self._admission.authenticated(peer[0])
        self._wake()
        left = max(0.1, self.handshake_timeout_s - (time.monotonic() - began))
        try:
            hello = _bounded(conn, left, lambda: read_hello(conn, left))
            on_hello(no_delay(conn), hello)
        except Exception as exc:  # noqa: BLE001 - a key holder's bad hello (missing fields, not a hello)
            logger.warning(f"hub: the hello from {peer[0]}:{peer[1]} was refused ({type(exc).__name__}: {exc})")
            with self._lock:
                self.refused += 1
            conn.close()


def _bounded(conn: Connection, seconds: float, step: Callable[[], T]) -> T:
    """Run `step`'s reads and writes on `conn` within `seconds` in all (not each: no slow drip)."""
    watchdog = Deadline(conn, seconds)
    try:
        set_io_timeout(conn, seconds)
        out = step()
    except Exception:
        if not watchdog.disarm():
            raise TimeoutError(f"not done within {seconds:g} s") from None
        raise
    if not watchdog.disarm():
        raise TimeoutError(f"not done within {seconds:g} s")
    set_io_timeout(conn, 0)
    return out


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

    def wait(
        self, timeout: float, failed: Callable[[], Optional[str]] = lambda: None
    ) -> list[tuple[Connection, Hello]]:
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
                    raise TimeoutError(f"instances {missing} did not connect to the front end within {timeout:g} s")
                self._cond.wait(min(left, 0.5))
            return [self.conns[i] for i in range(self.count)]

    def hand_over(self, later: OnHello) -> None:
        with self._cond:
            self.later = later

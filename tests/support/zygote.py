"""A zygote for the suite's `dist-infer` commands: one process imports torch and the package once,
and every command a test starts is forked from it instead of importing them again.

Why: importing torch is most of what a small job costs (docs/benchmarks.md, "The suite's time"),
and the suite starts hundreds of them. The launcher already forks its local ranks the same way
(dist_infer/launch/forked_start.py); this takes the one import left, the launcher's own.

A test still gets a real subprocess.Popen: `command()` rewrites the command line to run
tests/support/zygote_client.py, which passes its argv, environment, working directory and standard
streams to the zygote, forwards signals and ends with the forked command's status. What runs is the
real program (`dist_infer.cli.main.main`) in a real process, in its own session, with the test's
environment. Commands whose environment changes how modules import (PYTHONPATH, LD_PRELOAD,
TRITON_INTERPRET, ...) and commands of other programs (torchrun, mpirun, srun) are started as
before, by exec; `DIST_INFER_TEST_ZYGOTE=off` starts every one by exec.

The zygote stays single-threaded (a forked child of a threaded process can deadlock) and ends with
the test process (PDEATHSIG); a command whose client is killed is killed with its session.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, NoReturn, Optional, Sequence

SWITCH_ENV = "DIST_INFER_TEST_ZYGOTE"
CLIENT = Path(__file__).resolve().parent / "zygote_client.py"
# what the commands import before their first step, beyond the launcher's own preload
EXTRA_PRELOAD = ("dist_infer.cli.main", "dist_infer.launch.launcher")
# variables read while modules import: a command that sets them differently is started by exec
IMPORT_TIME_VARS = ("PYTHONPATH", "PYTHONHOME", "LD_PRELOAD", "LD_LIBRARY_PATH", "TRITON_INTERPRET")
IMPORT_TIME_PREFIXES = ("PYTHON", "OPENBLAS_", "MKL_", "KMP_", "GOMP_", "TORCH_", "CUDA_")
ALLOWED_PYTHON_VARS = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER")


def import_time_env(env: Mapping[str, str], default_path: str = "") -> dict[str, str]:
    """The part of `env` that decides how modules import (what the zygote's must equal); no
    PYTHONPATH counts as `default_path`, where the installed package is found without one."""
    found = {
        key: value
        for key, value in env.items()
        if key not in ALLOWED_PYTHON_VARS and (key in IMPORT_TIME_VARS or key.startswith(IMPORT_TIME_PREFIXES))
    }
    found.setdefault("PYTHONPATH", default_path)
    return found


def _installed_package_root(env: Mapping[str, str]) -> str:
    """The folder `import dist_infer` finds without PYTHONPATH (the editable install's checkout)."""
    plain = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    probe = "import importlib.util, os; print(os.path.dirname(os.path.dirname(importlib.util.find_spec('dist_infer').origin)))"
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], env=plain, cwd="/", capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


# ---- the test side -------------------------------------------------------------------------------


class _Zygote:
    """The one zygote of this test process, started on first use."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.sock_path = ""
        self.env: dict[str, str] = {}
        self.default_path = ""  # what no PYTHONPATH means: where the installed package is
        self.failed = False

    def ready(self) -> bool:
        if self.failed:
            return False
        if self.proc is None:
            if threading.current_thread() is not threading.main_thread():
                return False  # PDEATHSIG follows the thread that starts it: only the main one lasts
            self._start()
        return self.proc is not None and self.proc.poll() is None

    def _start(self) -> None:
        from dist_infer.topology.processes import die_with_parent
        from tests.support.paths import REPO
        from tests.support.processes import checkout_env

        self.env = checkout_env()
        self.default_path = _installed_package_root(self.env)
        self.env.pop("OMP_NUM_THREADS", None)  # each command sets its own share of the cores
        folder = tempfile.mkdtemp(prefix="dist-infer-zygote-")
        self.sock_path = os.path.join(folder, "zygote.sock")
        log = open(os.path.join(folder, "zygote.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", self.sock_path],
            env=self.env,
            cwd=str(REPO),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(self.sock_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.failed = True  # the commands start by exec, as without a zygote
                return
            time.sleep(0.05)


_ZYGOTE = _Zygote()


def command(cmd: Sequence[str], env: Optional[Mapping[str, str]]) -> list[str]:
    """`cmd` as the test should start it: through the zygote when it can run it, else unchanged."""
    from dist_infer.launch.forked_start import own_command_args

    cmd = [str(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    if env.get(SWITCH_ENV, os.environ.get(SWITCH_ENV, "on")) == "off" or own_command_args(cmd) is None:
        return cmd
    if not _ZYGOTE.ready():
        return cmd
    if import_time_env(env, _ZYGOTE.default_path) != import_time_env(_ZYGOTE.env, _ZYGOTE.default_path):
        return cmd  # its modules would import differently from the zygote's
    return [sys.executable, "-E", "-S", str(CLIENT), _ZYGOTE.sock_path, *cmd]


# ---- the zygote ----------------------------------------------------------------------------------


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    size = struct.unpack("!I", data[:4])[0]
    body = data[4:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the client went away mid-request")
        body += chunk
    return json.loads(body), fds


def _program_name(argv: list[str]) -> str:
    if argv[1:3] == ["-m", "dist_infer"]:
        import dist_infer.__main__ as entry

        return str(entry.__file__)
    return argv[0]


def _become_command(request: dict, fds: list[int], keep_closed: list[socket.socket]) -> None:
    """What the exec'd command would have had: its own session, its streams, directory and
    environment, default signal handlers, its own random state and its share of the cores."""
    from dist_infer.launch.forked_start import reset_inherited_state
    from dist_infer.topology.processes import die_with_parent

    os.setsid()
    die_with_parent()
    for sock in keep_closed:
        sock.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    reset_inherited_state(threads_when_unset=len(os.sched_getaffinity(0)))


def _run_command(request: dict, fds: list[int], keep_closed: list[socket.socket]) -> NoReturn:
    from dist_infer.launch.forked_start import own_command_args, run_forked_command

    argv = request["argv"]
    run_forked_command(
        own_command_args(argv) or [], lambda: _become_command(request, fds, keep_closed), _program_name(argv)
    )


class _Server:
    """Accept requests, fork each command, report its pid and its exit; one thread."""

    def __init__(self, sock_path: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(sock_path + ".tmp")
        self.listener.listen(64)
        os.rename(sock_path + ".tmp", sock_path)  # the test waits for the name: it appears listening
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.clients: dict[int, socket.socket] = {}  # a running command's pid -> its client

    def serve(self) -> NoReturn:
        while True:
            for key, _ in self.selector.select(timeout=0.05):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._client_readable(key.fileobj)  # type: ignore[arg-type]
            self._reap()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            return
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_command(request, fds, [self.listener, conn, *self.clients.values()])
        for fd in fds:
            os.close(fd)
        self.clients[pid] = conn
        self._send(conn, {"pid": pid})
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _client_readable(self, conn: socket.socket) -> None:
        """A client only ever closes: it was killed, so its command is killed with its session."""
        try:
            if conn.recv(1):
                return
        except OSError:
            pass
        pid = self.selector.get_key(conn).data
        self.selector.unregister(conn)
        conn.close()
        self.clients.pop(pid, None)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            conn = self.clients.pop(pid, None)
            if conn is not None:
                self._send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                self.selector.unregister(conn)
                conn.close()

    @staticmethod
    def _send(conn: socket.socket, message: dict) -> None:
        try:
            conn.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass


def main(sock_path: str) -> NoReturn:
    from dist_infer.launch.forked_start import PRELOAD, RankForker, thread_count
    from dist_infer.topology.processes import die_with_parent

    die_with_parent()
    forker = RankForker((*PRELOAD, *EXTRA_PRELOAD))
    if not forker.ready():
        print(f"zygote: cannot fork safely ({thread_count()} threads); commands start by exec", flush=True)
        sys.exit(1)
    _Server(sock_path).serve()


if __name__ == "__main__":
    main(sys.argv[1])

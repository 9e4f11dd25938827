"""Ending processes: stop child process groups (TERM, then KILL), end this process now without the
interpreter's teardown, and tie a child's life to its parent's. Standard library only (MPI only if the process loaded it)."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from typing import NoReturn, Optional, Protocol, Sequence


class ChildProcess(Protocol):
    """A started child as a launcher watches it: subprocess.Popen, or a rank forked from the launcher."""

    pid: int

    def poll(self) -> Optional[int]: ...

    def wait(self, timeout: Optional[float] = None) -> int: ...


def stop_process_groups(procs: Sequence[ChildProcess], grace: float = 3.0) -> None:
    """TERM each process group (started with start_new_session), KILL what is left after `grace` s."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def exit_now(code: int) -> NoReturn:
    """End a finished program without the interpreter's teardown, which is slow once torch is
    loaded (clearing its modules; docs/benchmarks.md, "What a local job pays to start and end") and
    can abort in C++ destructors (DeepSpeed's CPU ranks) after the work succeeded. What teardown
    does that matters still happens: the streams are flushed, the atexit handlers run (the process
    group's), and MPI is finalized (mpirun counts a rank that skips it as failed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent() -> None:
    """A child's preexec_fn (Linux): SIGKILL this process when the thread that started it dies, so a
    launcher killed outright (or a cluster node lost, taking the process that owned the job) leaves
    no orphaned ranks behind. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(137)

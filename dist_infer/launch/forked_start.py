"""Local ranks started by fork from a launcher that imported torch once, instead of each by exec.

Importing torch costs every rank seconds of CPU (docs/benchmarks.md, "What a local job pays to
start and end"), and N ranks on one node pay it N times at once. When a rank runs this package
(`python -m dist_infer ...`, what `--nproc` and `serve --instances` start), the launcher imports the
modules a rank needs once and forks each rank from itself, as vLLM starts its local workers.

Fork is only safe from a process with one thread: a thread pool (OpenMP's too, once torch has
computed anything) does not survive it. A launcher with any other thread, or
DIST_INFER_RANK_START=exec, starts its ranks by exec as before.
"""

from __future__ import annotations

import importlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Callable, Mapping, NoReturn, Optional, Sequence

from loguru import logger

from dist_infer.topology.processes import die_with_parent, exit_now

START_ENV = "DIST_INFER_RANK_START"
_BLAS_THREADS = "OPENBLAS_NUM_THREADS"
_SCRIPT_ENTRY = "from dist_infer.cli.main import run"  # what pip writes into the `dist-infer` script
_SCRIPT_HEAD_BYTES = 1024
START_METHODS = ("fork", "exec")
# what a rank of generate, bench or serve imports before its first step: torch and the engine's stack
PRELOAD = ("torch", "dist_infer.comm", "dist_infer.engine.engine_core", "dist_infer.models.loader")


class RankStartError(ValueError):
    """DIST_INFER_RANK_START names no start method."""


def start_method(env: Optional[Mapping[str, str]] = None) -> str:
    """The configured way to start local ranks: `fork` (the default on Linux) or `exec`."""
    given = (os.environ if env is None else env).get(START_ENV, "")
    default = "fork" if sys.platform.startswith("linux") else "exec"
    method = given.strip().lower() or default
    if method not in START_METHODS:
        raise RankStartError(f"{START_ENV}={given!r}: expected one of {', '.join(START_METHODS)}")
    return method


def own_command_args(argv: Sequence[str]) -> Optional[list[str]]:
    """The arguments of `python -m dist_infer ARGS` run by this very interpreter, or of this
    environment's `dist-infer ARGS` script, else None (a command of another program or of another
    Python environment cannot be run by forking this one)."""
    if len(argv) >= 3 and argv[0] == sys.executable and list(argv[1:3]) == ["-m", "dist_infer"]:
        return list(argv[3:])
    if argv and _is_own_script(argv[0]):
        return list(argv[1:])
    return None


def _is_own_script(program: str) -> bool:
    """Whether `program` is the `dist-infer` console script of this interpreter's environment."""
    path = program if os.sep in program else shutil.which(program)
    if not path:
        return False
    try:
        with open(path, "rb") as script:
            head = script.read(_SCRIPT_HEAD_BYTES).decode("utf-8", "replace")
    except OSError:
        return False
    shebang = head.splitlines()[0] if head.startswith("#!") else ""
    interpreter = shebang[2:].strip()
    same_env = bool(interpreter) and os.path.dirname(interpreter) == os.path.dirname(sys.executable)
    return same_env and _SCRIPT_ENTRY in head


def thread_count() -> int:
    """Threads of this process, the native ones included (OpenMP's pool is invisible to `threading`)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0  # not known: callers treat this as unsafe


class ForkedRank:
    """A forked rank as the launcher watches a subprocess.Popen: pid, poll, wait, returncode."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: nothing left to know
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        return code


class RankForker:
    """Forks local ranks of this package once its modules are imported; says when it cannot."""

    def __init__(self, preload: Sequence[str] = PRELOAD):
        self.preload = tuple(preload)
        self._loaded: Optional[bool] = None
        self._said_exec = False

    def ready(self) -> bool:
        """Whether a rank can be forked now: the modules imported (once) and one thread."""
        if self._loaded is None:
            self._loaded = self._import_preload()
        if not self._loaded:
            return False
        threads = thread_count()
        if threads != 1:
            self._say_exec(f"this launcher has {threads or 'an unknown number of'} threads")
        return threads == 1

    def _say_exec(self, why: str) -> None:
        """Tell once, where the user sees it, that ranks pay their own imports (and why)."""
        if not self._said_exec:
            self._said_exec = True
            logger.info(f"local ranks start by exec, each importing torch: {why}")

    def _import_preload(self) -> bool:
        """Import the ranks' modules here. numpy's OpenBLAS starts a thread pool as it loads unless
        told to use one thread: for this launcher it is told so (a rank's products run in torch)."""
        blas_threads = os.environ.get(_BLAS_THREADS)
        os.environ[_BLAS_THREADS] = "1"
        try:
            for name in self.preload:
                importlib.import_module(name)
            return True
        except Exception as exc:  # noqa: BLE001 - the ranks will report it themselves, by exec
            self._say_exec(f"importing their modules here failed ({exc})")
            return False
        finally:
            if blas_threads is None:
                os.environ.pop(_BLAS_THREADS, None)
            else:
                os.environ[_BLAS_THREADS] = blas_threads

    def fork(self, args: list[str], env: dict[str, str]) -> ForkedRank:
        """Start `python -m dist_infer ARGS` with `env` added, as a forked child in its own session."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_rank(args, env)
        return ForkedRank(pid, ["dist_infer", *args])


def exit_code_of(exc: SystemExit) -> int:
    """What the interpreter does with an uncaught SystemExit: its code, or 1 after printing its
    message to stderr (`raise SystemExit("why")`, the CLI's way of refusing input)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def reset_inherited_state(threads_when_unset: Optional[int] = None) -> None:
    """What a forked child takes over from its parent but an exec'd program would not have had:
    the parent's signal handlers, its random state, and its share of the cores (OpenMP read
    OMP_NUM_THREADS when the parent loaded it; `threads_when_unset` where the variable is absent)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    given = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(given) if given.isdigit() and int(given) > 0 else threads_when_unset
    if threads:
        import torch

        torch.set_num_threads(threads)


def _become_fresh_rank(env: dict[str, str]) -> None:
    """What an exec'd rank would have had: its own session, death with the launcher, its
    environment, and nothing inherited it should not have."""
    os.setsid()
    die_with_parent()
    os.environ.update(env)
    reset_inherited_state()


def _run_rank(args: list[str], env: dict[str, str]) -> NoReturn:
    """The forked child: become a rank, run the command, end without returning to the launcher."""
    run_forked_command(args, lambda: _become_fresh_rank(env), sys.argv[0])


def run_forked_command(args: list[str], become: Callable[[], None], program: str) -> NoReturn:
    """A forked child's life: `become` what an exec'd `program ARGS` would be, run the CLI, and
    end as the interpreter would (exit code, SystemExit's message), never returning to the parent."""
    code = 1
    try:
        become()
        sys.argv = [program, *args]
        from dist_infer.cli.main import main

        code = main(args)
    except SystemExit as exc:
        code = exit_code_of(exc)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - a child must never fall back into its parent's code
        traceback.print_exc()
        code = 1
    try:
        exit_now(code)
    finally:
        os._exit(code)

"""Build the native CPU kernels (cpu_kernels.c, decode_stack.c) once per node, and load them.

The shared library is compiled for this CPU (-march=native) into a cache directory keyed by the
source, the flags and the CPU's feature flags, so a cluster with mixed nodes or an edited kernel
never loads a stale build. Every rank of a node starts at once: one takes the build's lock (flock
on a file beside the library) and compiles, the others wait for it (bounded) and load its result.
The library is compiled under a temporary name and renamed into place, so no one loads half a
file, and the compiler runs under a timeout, killed with everything it started when it passes.

What a failed build means is the build mode, `DIST_INFER_KERNELS=auto|require|off` (the
--native-kernels flag, where given, wins): auto falls back to torch's ops with one warning naming
the cause, require raises with the compiler's error, off never builds. A cache directory that
cannot be used (a file, read-only, full, another user's) is not a failure: the next one is tried, a
private directory under the system's temp dir. A library is only loaded from a directory that this
user alone can write to (and whose parent is this user's or root's): anyone else who could would
choose the code every rank runs.

Nothing is built at install time: -march=native must match the CPU that runs the library, and a
wheel or a shared install is built on one machine and run on others.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Union

from loguru import logger

from dist_infer.kernels.cpu_kernels import CpuKernels

MODES = ("auto", "require", "off")
MODE_ENV = "DIST_INFER_KERNELS"
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_kernels.c", "decode_stack.c"))
HEADER = Path(__file__).with_name("cpu_kernels.h")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
VARIANTS = ((FLAGS + ("-fopenmp",), True), (FLAGS, False))  # (flags, threaded): with OpenMP where it builds
COMPILE_TIMEOUT_S = 300.0  # a compile takes seconds; the margin is for a slow or loaded machine
LOCK_TIMEOUT_S = COMPILE_TIMEOUT_S + 60.0  # a waiter outlasts the compile it waits for
MIN_FREE_BYTES = 16 << 20  # the library is ~0.2 MB; less free than this and the next directory is tried


class KernelBuildError(RuntimeError):
    """The native kernels could not be built or loaded (an error under DIST_INFER_KERNELS=require)."""


class _CompilerFailed(Exception):
    """The compiler exited non-zero, with this complaint (other flags may still build)."""


def kernel_mode(requested: Union[str, bool, None] = None, environ: Optional[Mapping[str, str]] = None) -> str:
    """auto, require or off: `requested` where it says (--native-kernels's; True defers, False is
    off), else $DIST_INFER_KERNELS, else auto. Any other value is a ValueError naming its source."""
    if requested is False:
        return "off"
    if requested is not None and requested is not True:
        if requested not in MODES:
            raise ValueError(f"native kernels mode {requested!r}: one of {', '.join(MODES)}")
        return requested
    value = (os.environ if environ is None else environ).get(MODE_ENV, "").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: one of {', '.join(MODES)}")
    return value


def compiler_command(environ: Optional[Mapping[str, str]] = None) -> tuple[str, ...]:
    """$CC split as a shell would (it may be `ccache gcc`), else cc, else gcc."""
    cc = (os.environ if environ is None else environ).get("CC", "").strip()
    if cc:
        return tuple(shlex.split(cc))
    return ("cc",) if shutil.which("cc") or not shutil.which("gcc") else ("gcc",)


def cache_dirs(environ: Optional[Mapping[str, str]] = None) -> tuple[Path, ...]:
    """Where a build may go, in order: $DIST_INFER_CACHE/kernels (else ~/.cache/dist_infer/kernels,
    where there is a home), then a directory of this user's under the system's temp dir."""
    env = os.environ if environ is None else environ
    home = os.path.expanduser("~")
    root = env.get("DIST_INFER_CACHE") or (os.path.join(home, ".cache", "dist_infer") if home != "~" else "")
    private_tmp = Path(tempfile.gettempdir()) / f"dist_infer-{os.geteuid()}" / "kernels"
    return ((Path(root) / "kernels",) if root else ()) + (private_tmp,)


@dataclass(frozen=True)
class KernelBuild:
    """How and where this process builds the kernels; `from_environment` gives the defaults."""

    mode: str
    compiler: tuple[str, ...]
    cache_dirs: tuple[Path, ...]  # tried in order
    compile_timeout_s: float = COMPILE_TIMEOUT_S
    lock_timeout_s: float = LOCK_TIMEOUT_S

    @classmethod
    def from_environment(cls, mode: Union[str, bool, None] = None) -> "KernelBuild":
        return cls(kernel_mode(mode), compiler_command(), cache_dirs())


def prepare_cache_dir(path: Path, uid: int) -> None:
    """Make `path` (and its parents, private to this user) and check that no other user can put a
    library into it: it must be `uid`'s, its parent `uid`'s or root's; group and others lose write
    permission on it. OSError where it cannot be used (a file on the way, read-only, another's)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another rank made it first
            p.mkdir(mode=0o700)
    st, parent = path.stat(), path.parent.stat()
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    if st.st_uid != uid or parent.st_uid not in (uid, 0):
        owner = st.st_uid if st.st_uid != uid else parent.st_uid
        raise PermissionError(
            errno.EPERM,
            f"owned by uid {owner}, not by this user ({uid}): another user could replace the library",
            str(path if st.st_uid != uid else path.parent),
        )
    if st.st_mode & 0o022:
        os.chmod(path, st.st_mode & 0o755)


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def library_name(flags: tuple[str, ...]) -> str:
    """The cached library's file name: a digest of the sources, `flags` and this CPU's features."""
    source = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    return f"cpu_kernels-{key}.so"


@contextlib.contextmanager
def _build_lock(path: Path, timeout_s: float) -> Iterator[bool]:
    """An exclusive flock on `path`, waited for up to `timeout_s` (KernelBuildError past it); yields
    whether another process held it first."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline, told = time.monotonic() + timeout_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernelBuildError(
                        f"another process held the build lock {path} for over {timeout_s:g} s "
                        "(a build that hangs, or a stopped process)"
                    ) from None
                if not told:
                    logger.info(f"waiting for another process to build the native CPU kernels ({path})")
                    told = True
                time.sleep(0.05)
        yield told
    finally:
        os.close(fd)  # releases the lock


def _compile(compiler: tuple[str, ...], flags: tuple[str, ...], target: Path, timeout_s: float) -> None:
    """Compile the sources into a temporary file beside `target`, then rename it into place.
    _CompilerFailed with the compiler's complaint; KernelBuildError where it runs past `timeout_s`
    (it is killed, with the cc1/as/ld it started: they share its new process group)."""
    fs = os.statvfs(target.parent)
    if fs.f_bavail * fs.f_frsize < MIN_FREE_BYTES:  # else the compiler's own complaint would end the build
        raise OSError(errno.ENOSPC, f"under {MIN_FREE_BYTES >> 20} MiB free", str(target.parent))
    fd, tmp = tempfile.mkstemp(prefix=f"{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        try:
            proc = subprocess.Popen(
                [*compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            raise _CompilerFailed(f"cannot run {compiler[0]}: {exc}") from None
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise KernelBuildError(
                f"the compiler ({shlex.join(compiler)}) ran past {timeout_s:g} s and was killed"
            ) from None
        if proc.returncode != 0:
            raise _CompilerFailed(err.strip()[-2000:] or f"{compiler[0]} exited with status {proc.returncode}")
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def build_library(
    compiler: tuple[str, ...],
    flags: tuple[str, ...],
    target: Path,
    compile_timeout_s: float = COMPILE_TIMEOUT_S,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
) -> None:
    """Make sure `target` exists: compiled here under its lock, or by whoever held the lock first.
    Raises _CompilerFailed, KernelBuildError (a timeout) and OSError (the directory's)."""
    if target.exists():
        return
    failed, asked = target.with_name(target.name + ".failed"), time.time()
    with _build_lock(target.with_name(target.name + ".lock"), lock_timeout_s) as waited:
        if target.exists():  # built while this process waited
            return
        if waited and failed.exists() and failed.stat().st_mtime >= asked - 1:
            _raise_failure(failed.read_text())  # failed while this process waited: not N compiles, N timeouts
        try:
            _compile(compiler, flags, target, compile_timeout_s)
        except (_CompilerFailed, KernelBuildError) as exc:
            with contextlib.suppress(OSError):  # the failure itself is what to report
                failed.write_text(f"{type(exc).__name__}\n{exc}")
            raise
        with contextlib.suppress(FileNotFoundError):
            failed.unlink()


def _raise_failure(record: str) -> None:
    """Raise the failure another process recorded (`type name\nmessage`) as it was raised there."""
    kind, _, message = record.partition("\n")
    raise (KernelBuildError if kind == KernelBuildError.__name__ else _CompilerFailed)(message)


def _load_from(directory: Path, compiler: tuple[str, ...], build: KernelBuild) -> CpuKernels:
    """The kernels built in `directory`, OpenMP's variant first. KernelBuildError where the compiler
    fails every variant (another directory would not help); OSError where the directory fails."""
    failures = []
    for flags, threaded in VARIANTS:
        target = directory / library_name(flags)
        try:
            build_library(compiler, flags, target, build.compile_timeout_s, build.lock_timeout_s)
        except _CompilerFailed as exc:
            failures.append(f"`{shlex.join(compiler)} {' '.join(flags)}` failed: {exc}")
            logger.debug(failures[-1])
            continue
        return CpuKernels(ctypes.CDLL(str(target)), threaded)  # OSError (a noexec mount): the next directory
    raise KernelBuildError("\n".join(failures))


def _build_and_load(build: KernelBuild) -> tuple[CpuKernels, list[str]]:
    """The kernels, and each cache directory passed over with why."""
    if not build.compiler or shutil.which(build.compiler[0]) is None:
        raise KernelBuildError(
            f"no C compiler: {build.compiler[0] if build.compiler else '$CC'!r} is not on PATH (set CC)"
        )
    passed_over: list[str] = []
    for directory in build.cache_dirs:
        try:
            prepare_cache_dir(directory, os.geteuid())
            return _load_from(directory, build.compiler, build), passed_over
        except OSError as exc:
            passed_over.append(f"{directory} is unusable ({exc})")
    raise KernelBuildError("no usable cache directory: " + "; ".join(passed_over))


def load_native_kernels(build: KernelBuild) -> Optional[CpuKernels]:
    """The kernels as `build` says: None under off; under auto None where they cannot be built,
    with one warning naming why; under require KernelBuildError, with the compiler's message."""
    if build.mode == "off":
        logger.debug(f"native CPU kernels off ({MODE_ENV}=off or --native-kernels off): torch ops used")
        return None
    try:
        kernels, passed_over = _build_and_load(build)
    except KernelBuildError as exc:
        if build.mode == "require":
            raise KernelBuildError(
                f"native CPU kernels required ({MODE_ENV}=require or --native-kernels require) but not built: {exc}"
            ) from None
        logger.warning(
            f"native CPU kernels not built, torch ops used instead ({MODE_ENV}=require makes this an error): {exc}"
        )
        return None
    if passed_over:
        logger.warning(f"native CPU kernels built in {Path(kernels.library_path).parent}, as " + "; ".join(passed_over))
    return kernels


def load_cpu_kernels(mode: Union[str, bool, None] = None) -> Optional[CpuKernels]:
    """The kernels for this machine, built on the first call (on disk once per node, loaded once per
    process and mode). `mode`: auto, require or off; None: $DIST_INFER_KERNELS's, else auto."""
    return _loaded(kernel_mode(mode))


@functools.lru_cache(maxsize=None)
def _loaded(mode: str) -> Optional[CpuKernels]:
    return load_native_kernels(KernelBuild.from_environment(mode))

"""Building the native kernels safely (kernels/build.py): cache directories that cannot be used fall
back with one warning, the build modes, the compiler's timeout, and one compile for many builders.

The compilers are stand-ins (tests/support/fake_compilers.py) that copy a library the real compiler
built once, so each test is quick; two real processes building at once is
tests/integration/test_kernel_build_processes.py."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from loguru import logger

from dist_infer.kernels import build, load_cpu_kernels
from dist_infer.kernels.build import (
    FLAGS,
    KernelBuild,
    KernelBuildError,
    build_library,
    cache_dirs,
    compiler_command,
    kernel_mode,
    library_name,
    load_native_kernels,
    prepare_cache_dir,
)
from dist_infer.launch.model_options import native_kernel_mode
from tests.support.fake_compilers import copying_compiler, failing_compiler, hanging_compiler, runs


@pytest.fixture(scope="module")
def real_library() -> str:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the native kernels are not built")
    return kernels.library_path


@contextlib.contextmanager
def warnings_logged():
    records: list[str] = []
    logger.enable("dist_infer")  # the library is quiet unless enabled (dist_infer/__init__.py)
    sink = logger.add(lambda message: records.append(message.record["message"]), level="WARNING")
    try:
        yield records
    finally:
        logger.remove(sink)
        logger.disable("dist_infer")


def works(kernels) -> bool:
    x, w = torch.randn(3, 32), torch.randn(5, 32)
    return torch.allclose(kernels.skinny_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocked", ["the directory", "a parent"])
def test_a_cache_dir_that_is_a_file_falls_back_with_one_warning(tmp_path, real_library, blocked):
    log, blocker = tmp_path / "runs.log", tmp_path / "cache"
    blocker.write_text("not a directory")
    first = blocker if blocked == "the directory" else blocker / "kernels"
    spec = KernelBuild("auto", copying_compiler(tmp_path, log, real_library), (first, tmp_path / "fallback"))
    with warnings_logged() as warnings:
        kernels = load_native_kernels(spec)
    assert kernels is not None and works(kernels)
    assert Path(kernels.library_path).parent == tmp_path / "fallback"
    assert len(warnings) == 1 and str(first) in warnings[0] and "not a directory" in warnings[0].lower()
    assert len(runs(log)) == 1


def _read_only(monkeypatch, directory: Path) -> None:
    """Creating a file under `directory` fails as on a read-only mount."""
    real_open = os.open

    def guarded_open(path, flags, *args, **kwargs):
        if str(path).startswith(str(directory)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)


def _full(monkeypatch, directory: Path) -> None:
    """`directory`'s file system reports no free blocks."""
    real_statvfs = os.statvfs

    def statvfs(path):
        st = real_statvfs(path)
        if str(path).startswith(str(directory)):
            return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, *st[5:]))
        return st

    monkeypatch.setattr(os, "statvfs", statvfs)


@pytest.mark.parametrize("cause", ["read-only", "full", "chmod 555"])
def test_a_read_only_or_full_cache_dir_falls_back(tmp_path, real_library, monkeypatch, cause):
    """A read-only mount (EROFS) and a full disk are injected; a directory without write permission
    is real (skipped where the process writes through it: root, unless its capabilities are dropped)."""
    log, first = tmp_path / "runs.log", tmp_path / "first"
    first.mkdir()
    if cause == "chmod 555":
        first.chmod(0o555)
        if os.access(first, os.W_OK):
            first.chmod(0o755)
            pytest.skip("this process writes through permissions (root with CAP_DAC_OVERRIDE)")
    else:
        (_read_only if cause == "read-only" else _full)(monkeypatch, first)
    spec = KernelBuild("auto", copying_compiler(tmp_path, log, real_library), (first, tmp_path / "fallback"))
    with warnings_logged() as warnings:
        kernels = load_native_kernels(spec)
    monkeypatch.undo()
    first.chmod(0o755)
    assert kernels is not None and Path(kernels.library_path).parent == tmp_path / "fallback"
    assert len(warnings) == 1 and str(first) in warnings[0]
    assert {"read-only": "Read-only file system", "full": "MiB free", "chmod 555": "Permission denied"}[
        cause
    ] in warnings[0]
    assert [Path(p).parent for p in runs(log)] == [tmp_path / "fallback"]


def test_no_usable_dir_at_all_is_one_warning_and_torch_ops(tmp_path, real_library):
    blocker = tmp_path / "file"
    blocker.write_text("")
    spec = KernelBuild(
        "auto", copying_compiler(tmp_path, tmp_path / "runs.log", real_library), (blocker / "a", blocker / "b")
    )
    with warnings_logged() as warnings:
        assert load_native_kernels(spec) is None
    assert len(warnings) == 1 and "no usable cache directory" in warnings[0] and str(blocker / "b") in warnings[0]


def test_a_directory_another_user_could_write_to_is_refused(tmp_path):
    """Loading a library from a directory someone else can write to runs their code: another
    user's directory (or parent) is refused, and group/other write on this user's is taken away."""
    mine = tmp_path / "mine" / "kernels"
    prepare_cache_dir(mine, os.geteuid())
    assert mine.is_dir() and mine.stat().st_mode & 0o777 == 0o700
    mine.chmod(0o777)
    prepare_cache_dir(mine, os.geteuid())
    assert mine.stat().st_mode & 0o022 == 0
    with pytest.raises(PermissionError, match=f"owned by uid {os.geteuid()}, not by this user"):
        prepare_cache_dir(mine, os.geteuid() + 1)


def test_require_raises_with_the_compilers_message_and_auto_warns_once(tmp_path):
    log = tmp_path / "runs.log"
    cc = failing_compiler(tmp_path, log, "kernels.c:1: fatal error: no such header")
    with pytest.raises(KernelBuildError, match="no such header") as raised:
        load_native_kernels(KernelBuild("require", cc, (tmp_path / "a",)))
    assert "require" in str(raised.value)
    assert len(runs(log)) == 2  # with OpenMP, then without
    with warnings_logged() as warnings:
        assert load_native_kernels(KernelBuild("auto", cc, (tmp_path / "b",))) is None
    assert len(warnings) == 1 and "no such header" in warnings[0] and "DIST_INFER_KERNELS=require" in warnings[0]
    assert {p.suffix for p in (tmp_path / "a").iterdir()} == {".lock", ".failed"}  # no library, no temporary file


def test_require_with_cc_false_and_with_no_compiler_names_it(tmp_path):
    with pytest.raises(KernelBuildError, match="false exited with status 1"):
        load_native_kernels(KernelBuild("require", compiler_command({"CC": "false"}), (tmp_path,)))
    with pytest.raises(KernelBuildError, match="'no-such-cc-1234' is not on PATH"):
        load_native_kernels(KernelBuild("require", ("no-such-cc-1234",), (tmp_path,)))


def test_off_never_runs_the_compiler(tmp_path, monkeypatch):
    log = tmp_path / "runs.log"
    spec = KernelBuild("off", failing_compiler(tmp_path, log, "should not run"), (tmp_path / "c",))
    with warnings_logged() as warnings:
        assert load_native_kernels(spec) is None
    assert runs(log) == [] and warnings == [] and not (tmp_path / "c").exists()
    monkeypatch.setenv("DIST_INFER_KERNELS", "off")
    assert load_cpu_kernels() is None


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_hung_compiler_is_killed_at_the_timeout(tmp_path):
    log, pid_file = tmp_path / "runs.log", tmp_path / "sleep.pid"
    spec = KernelBuild("require", hanging_compiler(tmp_path, log, pid_file), (tmp_path / "c",), compile_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(KernelBuildError, match=r"ran past 0.5 s and was killed"):
        load_native_kernels(spec)
    assert time.monotonic() - start < 60  # not the hung compiler's 600 s
    assert len(runs(log)) == 1  # a timeout is not retried without OpenMP
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(sleeper), "the compiler's child outlived the timeout"
    name = library_name(FLAGS + ("-fopenmp",))
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [name + ".failed", name + ".lock"]  # no .tmp


def test_builders_at_once_compile_once_into_a_whole_file(tmp_path, real_library):
    """Four builders of one library (threads: flock locks are per open file, so each holds its
    own), the compiler slow enough that all of them arrive while it runs: one compile, into a
    temporary name renamed into place, and every builder returns with the library there."""
    log, directory = tmp_path / "runs.log", tmp_path / "c"
    directory.mkdir()
    cc = copying_compiler(tmp_path, log, real_library, delay_s=0.5)
    target = directory / library_name(FLAGS)
    start, errors = threading.Barrier(4), []

    def builder():
        start.wait()
        try:
            build_library(cc, FLAGS, target, compile_timeout_s=30, lock_timeout_s=60)
            assert target.stat().st_size == Path(real_library).stat().st_size
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=builder) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(runs(log)) == 1
    written = Path(runs(log)[0])
    assert written.parent == directory and written != target  # the compiler wrote a temporary name
    assert sorted(p.name for p in directory.iterdir()) == [target.name, target.name + ".lock"]
    build_library(cc, FLAGS, target)
    assert len(runs(log)) == 1  # built: no compile, no lock


@pytest.mark.parametrize("failure", ["fails", "hangs"])
def test_builders_waiting_on_a_failed_build_do_not_run_it_again(tmp_path, failure):
    """A compile that fails or times out is not repeated by each builder that waited for it (eight
    ranks behind a hung compiler would otherwise take eight timeouts): they raise what it raised."""
    log, target = tmp_path / "runs.log", tmp_path / "c" / "lib.so"
    target.parent.mkdir()
    cc = (
        failing_compiler(tmp_path, log, "kernels.c:9: error: boom", delay_s=2)
        if failure == "fails"
        else hanging_compiler(tmp_path, log, tmp_path / "sleep.pid")
    )  # both well past the builders' arrival
    start, raised, timeout_s = threading.Barrier(3), [], 2 if failure == "hangs" else 30

    def builder():
        start.wait()
        try:
            build_library(cc, FLAGS, target, compile_timeout_s=timeout_s, lock_timeout_s=60)
        except Exception as exc:  # noqa: BLE001 - checked below
            raised.append(exc)

    threads = [threading.Thread(target=builder) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(runs(log)) == 1 and len(raised) == 3
    if failure == "fails":
        assert all(type(e).__name__ == "_CompilerFailed" and "boom" in str(e) for e in raised), raised
    else:
        assert all(isinstance(e, KernelBuildError) and "ran past 2 s" in str(e) for e in raised)
    (tmp_path / "runs.log").unlink()
    with pytest.raises(Exception, match="boom|ran past"):  # a later build (nobody waiting) tries again
        build_library(cc, FLAGS, target, compile_timeout_s=timeout_s)
    assert len(runs(log)) == 1


def test_a_waiter_gives_up_at_the_lock_timeout(tmp_path):
    log, target = tmp_path / "runs.log", tmp_path / "lib.so"
    cc = failing_compiler(tmp_path, log, "should not run")
    with open(tmp_path / "lib.so.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(KernelBuildError, match="held the build lock .* for over 0.3 s"):
            build_library(cc, FLAGS, target, compile_timeout_s=30, lock_timeout_s=0.3)
    assert runs(log) == [] and not target.exists()


def test_the_mode_comes_from_the_flag_then_the_environment():
    assert kernel_mode(None, {}) == "auto"
    assert kernel_mode(None, {"DIST_INFER_KERNELS": " Require "}) == "require"
    assert kernel_mode("auto", {"DIST_INFER_KERNELS": "off"}) == "auto"  # the flag wins
    assert kernel_mode(True, {"DIST_INFER_KERNELS": "off"}) == "off"  # True defers to the environment
    assert kernel_mode(False, {"DIST_INFER_KERNELS": "require"}) == "off"
    with pytest.raises(ValueError, match="DIST_INFER_KERNELS='1': one of auto, require, off"):
        kernel_mode(None, {"DIST_INFER_KERNELS": "1"})
    with pytest.raises(ValueError, match="'on': one of auto, require, off"):
        kernel_mode("on", {})
    # --native-kernels: not given defers; on and layers build as auto
    assert [native_kernel_mode(f) for f in (None, "on", "layers", "require", "off")] == [
        True,
        "auto",
        "auto",
        "require",
        "off",
    ]


def test_the_compiler_and_the_cache_dirs_come_from_the_environment(tmp_path):
    assert compiler_command({"CC": "ccache gcc -m64"}) == ("ccache", "gcc", "-m64")
    assert compiler_command({"CC": " "}) in (("cc",), ("gcc",))
    dirs = cache_dirs({"DIST_INFER_CACHE": str(tmp_path)})
    assert dirs[0] == tmp_path / "kernels" and dirs[-1].parent.name == f"dist_infer-{os.geteuid()}"
    assert len(dirs) == 2 and build.cache_dirs({})[0].parts[-3:] == (".cache", "dist_infer", "kernels")

"""Local ranks forked from the launcher (dist_infer/launch/forked_start.py): which commands can be
forked and when forking is refused. Forking itself needs a process with one thread, which this
test process is not once torch has computed: tests/integration/test_forked_ranks.py forks from a
fresh process, and every integration test of generate and serve starts its ranks that way.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
from loguru import logger

from dist_infer.launch.forked_start import (
    START_ENV,
    RankForker,
    RankStartError,
    exit_code_of,
    own_command_args,
    start_method,
    thread_count,
)


def test_start_method_defaults_to_fork_on_linux_and_names_a_bad_value():
    assert start_method({}) == ("fork" if sys.platform.startswith("linux") else "exec")
    assert start_method({START_ENV: " EXEC "}) == "exec"
    with pytest.raises(RankStartError, match=f"{START_ENV}='spawn'.*fork, exec"):
        start_method({START_ENV: "spawn"})


def test_only_this_interpreter_running_this_package_is_forked():
    assert own_command_args([sys.executable, "-m", "dist_infer", "generate", "--tp", "2"]) == ["generate", "--tp", "2"]
    assert own_command_args([sys.executable, "-m", "dist_infer"]) == []
    assert own_command_args(["/other/python", "-m", "dist_infer", "generate"]) is None  # another venv's
    assert own_command_args([sys.executable, "-m", "other_package"]) is None
    assert own_command_args([sys.executable]) is None


def test_a_launcher_with_another_thread_starts_ranks_by_exec_not_fork():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()
    said: list[str] = []
    logger.enable("dist_infer")  # the library is quiet unless enabled
    sink = logger.add(lambda message: said.append(str(message)), level="INFO")
    try:
        forker = RankForker(preload=())
        assert thread_count() >= 2 and not forker.ready() and not forker.ready()
    finally:
        logger.remove(sink)
        logger.disable("dist_infer")
        stop.set()
        worker.join()
    # the user is told once per job, not once per rank, that the ranks pay their own imports
    assert len(said) == 1 and "local ranks start by exec" in said[0] and "threads" in said[0], said


def test_a_preload_that_fails_falls_back_to_exec():
    assert not RankForker(preload=("no_such_module_here",)).ready()


def _script(path, interpreter, body="from dist_infer.cli.main import run\n"):
    path.write_text(f"#!{interpreter}\nimport sys\n{body}")
    return str(path)


def test_this_environments_dist_infer_script_is_forked_and_another_one_is_not(tmp_path):
    here = os.path.join(os.path.dirname(sys.executable), "python3")  # pip writes the version's name
    assert own_command_args([_script(tmp_path / "dist-infer", here), "serve", "--tp", "2"]) == ["serve", "--tp", "2"]
    assert own_command_args([_script(tmp_path / "other-venv", "/elsewhere/bin/python3"), "serve"]) is None
    assert own_command_args([_script(tmp_path / "not-ours", here, "from other.cli import run\n")]) is None
    assert own_command_args([str(tmp_path / "missing"), "serve"]) is None
    assert own_command_args(["no-such-program-on-path", "serve"]) is None


def test_a_forked_commands_exit_message_reaches_stderr_as_the_interpreters_would(capsys):
    assert exit_code_of(SystemExit()) == 0 and exit_code_of(SystemExit(3)) == 3
    assert capsys.readouterr().err == ""
    assert exit_code_of(SystemExit("dist-infer generate: --json-schema: not JSON")) == 1
    assert capsys.readouterr().err == "dist-infer generate: --json-schema: not JSON\n"

"""`--cp auto` (cli/cp_auto.py): the ranks' command line rewritten for the prompt's length, started
by hand or under a launcher. (Through the real CLI: tests/integration/test_cp_model.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_cp_auto_rewrites_the_ranks_command_line(monkeypatch):
    from dist_infer.cli import cp_auto
    from dist_infer.cli.cp_auto import resolve_cp_auto
    from dist_infer.topology.discovery import discover

    monkeypatch.setattr(cp_auto, "discover", lambda env: None)  # started by hand
    args = SimpleNamespace(cp="auto", tp=1, pp=1, ep=1, nproc=4, log_level="INFO")
    argv = ["generate", "--cp", "auto", "--nproc", "4", "--prompt-ids", "@p"]
    assert resolve_cp_auto(args, argv, 9000) == ["generate", "--cp", "2", "--nproc", "2", "--prompt-ids", "@p"]
    assert (args.cp, args.nproc) == (2, 2), "4 ranks allowed, but 9000 tokens give only 2 of them 4096 each"
    args = SimpleNamespace(cp="auto", tp=2, pp=1, ep=1, nproc=None, log_level="INFO")
    assert resolve_cp_auto(args, ["bench", "--cp=auto", "--tp", "2"], 100) == ["bench", "--cp=1", "--tp", "2"]
    assert args.cp == 1
    # under a launcher (torchrun's variables) the ranks exist already: cp fills the job
    monkeypatch.setattr(cp_auto, "discover", lambda env: discover({"RANK": "0", "WORLD_SIZE": "4"}))
    args = SimpleNamespace(cp="auto", tp=2, pp=1, ep=1, nproc=None, log_level="INFO")
    resolve_cp_auto(args, ["generate", "--cp", "auto"], 100)
    assert args.cp == 2
    args = SimpleNamespace(cp="auto", tp=3, pp=1, ep=1, nproc=None, log_level="INFO")
    with pytest.raises(SystemExit, match="4 ranks do not divide by tp x pp x ep = 3"):
        resolve_cp_auto(args, ["generate", "--cp", "auto"], 100)

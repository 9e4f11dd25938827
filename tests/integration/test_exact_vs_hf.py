"""Tensor/pipeline-parallel generation through the real CLI, compared with HF transformers.

Every case writes a small seeded checkpoint, runs `dist-infer generate` as real processes (its own
local ranks, torchrun, mpirun, or `dist-infer launch`), and checks against HF's fp32 eager greedy
decoding of the same prompts:

- greedy token ids identical (the only excuse for a difference is a near tie in HF's logits at
  the first differing step, which the assertion message then states);
- every step's logits (from --dump-logits) within atol 1e-4 / rtol 1e-4;
- the JSON log-probabilities equal HF's log-softmax of the chosen token.

Seeded sampling is checked too: the same seed gives the same tokens whatever the tp size.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.hf_compare import ATOL, RTOL, CheckpointStore, assert_matches_hf, prompts_for
from tests.support.paths import VENV_BIN
from tests.support.processes import run

TIMEOUT_S = 120
NEW_TOKENS = 8


def _exe(name: str) -> str:
    path = VENV_BIN / name
    return str(path) if path.exists() else (shutil.which(name) or name)


SHORT = (5, 17, 40)
LONG = (33, 41, 50)  # llama31-rope: its scaling only moves wavelengths > 32 positions
SPLIT_LENGTHS = (600, 650)  # past split_attention's 512 keys (kernels/decode_stack.c)


def run_cli(args: list[str], timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return run(args, timeout)  # support/processes.py's: own session, the whole tree ended on timeout


def generate_args(model: Path, prompts: list[list[int]], dump: Path, extra: list[str]) -> list[str]:
    args = [
        "generate",
        "--model",
        str(model),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--no-eos-stop",
        "--json",
        "--dump-logits",
        str(dump),
    ]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    return args + extra


def parse_json(proc: subprocess.CompletedProcess, what: str) -> dict:
    assert proc.returncode == 0, (
        f"{what} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"{what}: no stdout\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


# --- checkpoints and references, built once per module --------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("exact"), NEW_TOKENS)


# --- the cases --------------------------------------------------------------------------------------

DIST = [_exe("dist-infer")]

# id: (arch, checkpoint overrides, prompt lengths, launcher prefix (None: dist-infer's own), generate flags)
CASES = {
    "gqa-tp1-pp1": ("llama-gqa", {}, SHORT, None, ["--nproc", "1"]),
    "gqa-tp2": ("llama-gqa", {}, SHORT, None, ["--tp", "2", "--nproc", "2"]),
    "gqa-tp4": ("llama-gqa", {}, SHORT, None, ["--tp", "4", "--nproc", "4"]),
    "gqa-pp2": ("llama-gqa", {}, SHORT, None, ["--pp", "2", "--nproc", "2"]),
    "gqa-tp2xpp2": ("llama-gqa", {}, SHORT, None, ["--tp", "2", "--pp", "2", "--nproc", "4"]),
    # tp 4 above the single kv head; a vocabulary of 131 that 4 does not divide (padded vocab shards)
    "mqa-tp4-vocab131": ("llama-mqa", {"vocab_size": 131}, SHORT, None, ["--tp", "4", "--nproc", "4"]),
    "qwen2-tp2": ("qwen2", {}, SHORT, None, ["--tp", "2", "--nproc", "2"]),
    "tied-tp2xpp2": ("llama-tied", {}, SHORT, None, ["--tp", "2", "--pp", "2", "--nproc", "4"]),
    "llama31rope-tp2": ("llama31-rope", {}, LONG, None, ["--tp", "2", "--nproc", "2"]),
    "mistral-pp2": ("mistral", {}, SHORT, None, ["--pp", "2", "--nproc", "2"]),
    "multishard-tp2": ("llama-gqa", {"max_shard_size": "100KB"}, SHORT, None, ["--tp", "2", "--nproc", "2"]),
    # explicit split, and KV blocks of 4 tokens so every prompt spans several non-adjacent blocks
    "gqa-pp2-split11-block4": (
        "llama-gqa",
        {},
        SHORT,
        None,
        ["--pp", "2", "--nproc", "2", "--pp-split", "1,1", "--block-size", "4"],
    ),
    "torchrun-tp2xpp2": (
        "llama-gqa",
        {},
        SHORT,
        [_exe("torchrun"), "--nproc-per-node", "4", "--no-python", *DIST],
        ["--tp", "2", "--pp", "2"],
    ),
    "mpirun-gloo-tp2xpp2": (
        "llama-gqa",
        {},
        SHORT,
        [_exe("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "4", *DIST],
        ["--tp", "2", "--pp", "2", "--backend", "gloo"],
    ),
    # chunks of at most 20 rows over 600+ keys: each rank's heads through split_attention (a few rows
    # over a long context, the keys split over the threads), under torchrun
    "torchrun-tp2-long-short-chunks": (
        "llama-gqa",
        {"max_position_embeddings": 1024},
        SPLIT_LENGTHS,
        [_exe("torchrun"), "--nproc-per-node", "2", "--no-python", *DIST],
        ["--tp", "2", "--max-batched-tokens", "20"],
    ),
    "mpirun-mpi-tp2xpp2": (
        "llama-gqa",
        {},
        SHORT,
        [_exe("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "4", *DIST],
        ["--tp", "2", "--pp", "2", "--backend", "mpi"],
    ),
    # token-splitting overlap forced on: every step cut in two halves, sequences straddling the cut
    "gqa-tp2-overlap-on": ("llama-gqa", {}, SHORT, None, ["--tp", "2", "--nproc", "2", "--overlap", "on"]),
    "launch-tp2": ("llama-gqa", {}, SHORT, [*DIST, "launch", "--nproc-per-node", "2", "--", *DIST], ["--tp", "2"]),
    # sequence parallelism on every step: reduce-scatter / all-gather through shared memory, through
    # gloo, and through MPI; tp 4 with token counts 4 does not divide (padded rows), Qwen2's biases
    "gqa-tp2-sp": ("llama-gqa", {}, SHORT, None, ["--tp", "2", "--nproc", "2", "--sequence-parallel", "on"]),
    "gqa-tp2-sp-gloo": (
        "llama-gqa",
        {},
        SHORT,
        None,
        ["--tp", "2", "--nproc", "2", "--sequence-parallel", "on", "--shm", "off"],
    ),
    "mqa-tp4-sp": ("llama-mqa", {}, SHORT, None, ["--tp", "4", "--nproc", "4", "--sequence-parallel", "on"]),
    "qwen2-tp2-sp": ("qwen2", {}, SHORT, None, ["--tp", "2", "--nproc", "2", "--sequence-parallel", "on"]),
    "mpirun-mpi-tp2-sp": (
        "llama-gqa",
        {},
        SHORT,
        [_exe("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "2", *DIST],
        ["--tp", "2", "--backend", "mpi", "--shm", "off", "--sequence-parallel", "on"],
    ),
}


def _flag(flags: list[str], name: str, default: int = 1) -> int:
    return int(flags[flags.index(name) + 1]) if name in flags else default


@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_hf(case, store, tmp_path):
    arch, overrides, lengths, prefix, flags = CASES[case]
    model = store.model(arch, **overrides)
    if "max_shard_size" in overrides:
        assert (model / "model.safetensors.index.json").is_file()
        assert len(list(model.glob("*.safetensors"))) > 1, "the checkpoint should be split into several files"
    prompts = prompts_for(lengths)
    ref_ids, ref_logits = store.reference(model, prompts)
    dump = tmp_path / "logits.pt"
    cmd = (prefix or DIST) + generate_args(model, prompts, dump, flags)
    out = parse_json(run_cli(cmd), case)
    par = out["parallel"]
    tp, pp = _flag(flags, "--tp"), _flag(flags, "--pp")
    assert (par["tp"], par["pp"], par["world_size"]) == (tp, pp, tp * pp), par
    if "--backend" in flags:
        assert flags[flags.index("--backend") + 1] in par["backend"], par
    assert dump.is_file(), "--dump-logits wrote nothing"
    assert_matches_hf(out, torch.load(dump), prompts, ref_ids, ref_logits, case)


def test_torch_ops_path_matches_hf(store, tmp_path):
    """The same exactness with the native CPU kernels switched off (--native-kernels off): the
    torch path stays the fallback on machines without a compiler, so it must stay exact too."""
    from tests.support.processes import venv_env

    model = store.model("llama-gqa")
    prompts = prompts_for(SHORT)
    ref_ids, ref_logits = store.reference(model, prompts)
    dump = tmp_path / "logits.pt"
    cmd = DIST + generate_args(model, prompts, dump, ["--tp", "2", "--nproc", "2", "--native-kernels", "off"])
    out = parse_json(run(cmd, TIMEOUT_S, env=venv_env()), "torch-ops-tp2")
    assert_matches_hf(out, torch.load(dump), prompts, ref_ids, ref_logits, "torch-ops-tp2")


EOS = 2
EOS_PROMPT_SEED = 45  # with llama-gqa, HF's greedy ids hit EOS at step 2 (prompt 0) and 1 (prompt 1), never in 2


def test_eos_stop_tp2xpp2_matches_hf(store, tmp_path):
    """Sequences of one microbatch finishing at different steps, the others going on."""
    model = store.model("llama-gqa")
    prompts = prompts_for(SHORT, seed=EOS_PROMPT_SEED)
    ref_ids, ref_logits = store.reference(model, prompts)
    stops = [ids.index(EOS) if EOS in ids else None for ids in ref_ids]
    assert stops == [2, 1, None], f"the fixture changed: HF's EOS steps are {stops}"
    dump = tmp_path / "logits.pt"
    args = [
        a
        for a in generate_args(model, prompts, dump, ["--tp", "2", "--pp", "2", "--nproc", "4"])
        if a != "--no-eos-stop"
    ]
    out = parse_json(run_cli(DIST + args), "eos")
    dumped = torch.load(dump)
    for b, (row, stop) in enumerate(zip(out["outputs"], stops)):
        n = NEW_TOKENS if stop is None else stop + 1
        assert row["finish_reason"] == ("length" if stop is None else "stop"), row
        assert row["token_ids"] == ref_ids[b][:n], f"prompt {b}: {row['token_ids']} vs HF {ref_ids[b]}"
        assert dumped[b].shape == (n, ref_logits[b].shape[1])
        torch.testing.assert_close(dumped[b], ref_logits[b][:n], atol=ATOL, rtol=RTOL)


# --- seeded sampling through the CLI ----------------------------------------------------------------


def _sample(store, tmp_path, seed: int, flags: list[str]) -> list[list[int]]:
    model = store.model("llama-gqa")
    prompts = prompts_for(SHORT)
    args = (
        DIST
        + generate_args(model, prompts, tmp_path / f"s{seed}{'-'.join(flags)}.pt", flags)
        + ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", str(seed)]
    )
    out = parse_json(run_cli(args), f"sampling seed {seed} {flags}")
    return [row["token_ids"] for row in out["outputs"]]


def test_seeded_sampling_independent_of_layout(store, tmp_path):
    tp2 = _sample(store, tmp_path, 7, ["--tp", "2", "--nproc", "2"])
    tp1 = _sample(store, tmp_path, 7, ["--nproc", "1"])
    assert tp2 == tp1, f"seed 7: tp2 sampled {tp2}, tp1 sampled {tp1}"
    tp2pp2 = _sample(store, tmp_path, 7, ["--tp", "2", "--pp", "2", "--nproc", "4"])
    assert tp2pp2 == tp1, f"seed 7: tp2 x pp2 (microbatches, sampling on the last stage) sampled {tp2pp2}, tp1 {tp1}"
    other = _sample(store, tmp_path, 8, ["--nproc", "1"])
    assert other != tp1, f"seeds 7 and 8 sampled the same tokens {tp1}"
    greedy = store.reference(store.model("llama-gqa"), prompts_for(SHORT))[0]
    assert tp1 != greedy, "temperature 0.8 sampling gave exactly the greedy tokens: sampling seems off"


# --- bf16 prompts (--prompt-dtype bfloat16) ---------------------------------------------------------------

BF16_ROUNDING_FLIP = 5e-3  # tests/unit/models/test_fused_decode_bf16.py says why


def _bf16_prompts_here() -> str | None:
    """Why bf16 prompts cannot run here, or None."""
    from dist_infer.kernels import load_cpu_kernels
    from dist_infer.kernels.gemm import cpu_bf16_instructions

    kernels = load_cpu_kernels()
    if kernels is None or kernels.gemm_bf16 is None:
        return "no native kernels or no oneDNN bf16 GEMM here"
    return None if cpu_bf16_instructions() else "this CPU has no bf16 matrix instructions"


@pytest.mark.parametrize(
    "case,prefix,flags",
    [
        ("pp2", None, ["--pp", "2", "--nproc", "2"]),
        ("tp2xpp2", None, ["--tp", "2", "--pp", "2", "--nproc", "4"]),
        ("torchrun-tp2", [_exe("torchrun"), "--nproc-per-node", "2", "--no-python", *DIST], ["--tp", "2"]),
        (
            "mpirun-mpi-pp2",
            [_exe("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "2", *DIST],
            ["--pp", "2", "--backend", "mpi"],
        ),
    ],
)
def test_bf16_prompts_match_the_rounded_reference_on_every_stage(case, prefix, flags, store, tmp_path):
    """Prompt tokens' products in bf16 on each pipeline stage and tensor shard (our ranks, torchrun,
    mpirun with MPI between the stages): HF with the same products rounded
    (tests/support/bf16_reference.py) gives the same ids and, within a bf16 rounding flip, the same logits."""
    why = _bf16_prompts_here()
    if why:
        pytest.skip(why)
    from tests.support.bf16_reference import bf16_prompt_products
    from tests.support.checkpoints import hf_reference, load_hf_model

    model = store.model("llama-gqa")
    prompts = prompts_for(SHORT)
    hf = load_hf_model(model)
    with bf16_prompt_products(hf):
        ref_ids, ref_logits = hf_reference(None, prompts, NEW_TOKENS, model=hf)
    dump = tmp_path / "logits.pt"
    cmd = (prefix or DIST) + generate_args(model, prompts, dump, [*flags, "--prompt-dtype", "bfloat16"])
    out = parse_json(run_cli(cmd), case)
    for row, got, want_ids, want in zip(out["outputs"], torch.load(dump), ref_ids, ref_logits):
        assert row["token_ids"] == want_ids
        torch.testing.assert_close(got, want, atol=BF16_ROUNDING_FLIP, rtol=0)
    plain = store.reference(model, prompts)[1]
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(torch.load(dump), plain)), "no bf16 rounding was seen"


# --- the comparison itself ----------------------------------------------------------------------------


def test_comparison_accepts_only_near_ties():
    """assert_matches_hf lets ids differ only where HF's top-2 gap is < 1e-4, and then stops comparing."""
    vocab, prompts = 6, [[3, 4]]
    want = torch.zeros(NEW_TOKENS, vocab)
    want[:, 1] = 1.0
    want[3, 2] = 1.0 - 5e-5  # near tie at step 3
    ids = [[1] * NEW_TOKENS]

    def out(token_ids, logits):
        lp = torch.log_softmax(logits.double(), -1)[torch.arange(NEW_TOKENS), torch.tensor(token_ids)].tolist()
        return {"outputs": [{"prompt_token_ids": prompts[0], "token_ids": token_ids, "logprobs": lp}]}

    assert_matches_hf(out(ids[0], want), [want.clone()], prompts, ids, [want], "same")
    tie = [1, 1, 1, 2, 5, 5, 5, 5]  # took the other side of the tie; later steps see another context
    later = want.clone()
    later[3, 2] += 2e-5
    later[4:] = torch.randn(NEW_TOKENS - 4, vocab)
    assert_matches_hf(out(tie, later), [later], prompts, ids, [want], "tie")
    with pytest.raises(AssertionError, match="not a near tie"):
        assert_matches_hf(out([1, 0, 1, 1, 1, 1, 1, 1], want), [want.clone()], prompts, ids, [want], "no tie")
    off = want.clone()
    off[5, 4] += 1e-3
    with pytest.raises(AssertionError, match="step 5: logits differ"):
        assert_matches_hf(out(ids[0], want), [off], prompts, ids, [want], "off")

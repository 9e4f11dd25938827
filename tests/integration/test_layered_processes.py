"""Layered prefill (--prefill-schedule layered) as real processes, against HF transformers generating
each prompt alone: greedy ids identical, every step's logits (--dump-logits) within fp32 tolerance.

- `dist-infer generate --tp 2` of an MoE model (Qwen2-MoE shape) under our launcher, the token budget
  small enough that the longer prompts run in layer groups;
- the same with `--ep 2` over mpirun with the MPI backend (the experts' all-to-alls between groups);
- `dist-infer serve --tp 2` of a dense model, a fixed `--layer-groups 2`, a cache too small for a
  burst of concurrent requests (preemption, also of prompts in the middle of their layers);
- `dist-infer bench --compare layered`: the same command run again layered, beside ours (chunked),
  the MoE expert reads of both in the JSON.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch

from tests.support.checkpoints import hf_reference, write_hf_checkpoint
from tests.support.hf_compare import assert_matches_hf, prompts_for
from tests.support.processes import checkout_env, one_torch_thread, run, venv_exe  # noqa: F401 (a fixture)
from tests.support.serving_helpers import ServerJob, complete_ids, run_async, stream_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 5
TIMEOUT_S = 120  # a case takes a few seconds here; this only bounds a hang
PROMPTS = prompts_for([5, 19, 3, 14], seed=41)
SERVED = prompts_for([15, 17, 14, 16, 4], seed=42)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("layered-procs")
    return {
        "moe": write_hf_checkpoint(root, "qwen2-moe"),
        "dense": write_hf_checkpoint(root, "llama-gqa", num_hidden_layers=4),
    }


_refs: dict = {}


def _reference(path, prompts):
    key = (str(path), tuple(map(tuple, prompts)))
    if key not in _refs:
        _refs[key] = hf_reference(path, prompts, NEW)
    return _refs[key]


def _generate(prefix: list[str], model, dump, flags: list[str]) -> dict:
    cmd = [
        *prefix,
        "generate",
        "--model",
        str(model),
        "--max-new-tokens",
        str(NEW),
        "--no-eos-stop",
        "--json",
        "--dump-logits",
        str(dump),
        "--prefill-schedule",
        "layered",
        "--max-batched-tokens",
        "6",
        *flags,
    ]
    for p in PROMPTS:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = run(cmd, TIMEOUT_S, env=checkout_env())
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"no stdout\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_moe_tp2_generate_layered_matches_hf(checkpoints, tmp_path):
    dump = tmp_path / "logits.pt"
    out = _generate([venv_exe("dist-infer")], checkpoints["moe"], dump, ["--tp", "2", "--nproc", "2"])
    assert (out["parallel"]["tp"], out["parallel"]["world_size"]) == (2, 2), out["parallel"]
    ids, logits = _reference(checkpoints["moe"], PROMPTS)
    assert_matches_hf(out, torch.load(dump), PROMPTS, ids, logits, "qwen2-moe tp=2 layered")


def test_moe_ep2_generate_layered_over_mpirun_matches_hf(checkpoints, tmp_path):
    mpirun = shutil.which("mpirun") or venv_exe("mpirun")
    dump = tmp_path / "logits.pt"
    out = _generate(
        [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", venv_exe("dist-infer")],
        checkpoints["moe"],
        dump,
        ["--ep", "2", "--backend", "mpi", "--shm", "off"],
    )
    assert "mpi" in out["parallel"]["backend"] and out["parallel"]["world_size"] == 2, out["parallel"]
    ids, logits = _reference(checkpoints["moe"], PROMPTS)
    assert_matches_hf(out, torch.load(dump), PROMPTS, ids, logits, "qwen2-moe ep=2 layered over mpirun")


async def _burst(url: str, prompts) -> list[list[int]]:
    async with httpx.AsyncClient() as client:
        calls = [
            (stream_ids if i % 2 else complete_ids)(client, url, p, max_tokens=NEW, temperature=0, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*calls)
    return [r["token_ids"] if "token_ids" in r else r["choices"][0]["token_ids"] for r in results]


def test_served_layered_under_preemption_matches_hf(checkpoints, tmp_path):
    """9 blocks of 4 tokens hold about one 14-17 token prompt and its new tokens, so the burst preempts."""
    args = [
        "--model",
        checkpoints["dense"],
        "--nproc",
        "2",
        "--tp",
        "2",
        "--block-size",
        "4",
        "--max-batched-tokens",
        "7",
        "--kv-blocks",
        "9",
        "--max-num-seqs",
        "4",
        "--timeout",
        "60",
        "--prefill-schedule",
        "layered",
        "--layer-groups",
        "2",
        "--prefix-caching",
        "off",
    ]
    with ServerJob(tmp_path, args, env=checkout_env()) as server:
        got = run_async(_burst(server.url, SERVED))
        metrics = server.metrics()
        assert metrics["dist_infer:num_preemptions_total"] > 0, "the burst was meant to preempt"
        assert metrics["dist_infer:kv_cache_usage_perc"] == 0.0, "every block free again"
        assert server.stop() == 0, server.log()[-4000:]
    want, _ = _reference(checkpoints["dense"], SERVED)
    for i, (ids, ref) in enumerate(zip(got, want)):
        assert ids == ref, f"served layered, prompt {i} (len {len(SERVED[i])}): {ids} vs HF's {ref}"


def test_bench_compares_layered_prefill_with_its_expert_reads(checkpoints):
    cmd = [
        venv_exe("dist-infer"),
        "bench",
        "--model",
        str(checkpoints["moe"]),
        "--batch",
        "2",
        "--prompt-len",
        "48",
        "--gen-len",
        "3",
        "--max-batched-tokens",
        "12",
        "--compare",
        "layered",
        "--json",
    ]
    proc = run(cmd, TIMEOUT_S, env=checkout_env())
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-4000:]}"
    ours = json.loads([ln for ln in proc.stdout.splitlines() if ln.strip()][-1])
    peer = ours["compare"]["layered"]
    assert peer["ok"], peer.get("error")
    assert (ours["prefill_schedule"], peer["prefill_schedule"]) == ("chunked", "layered")
    reads = ours["moe"]["expert_reads"]["prompt"], peer["moe"]["expert_reads"]["prompt"]
    assert 0 < reads[1] < reads[0], f"layered reads each expert once per prompt, chunked once per chunk: {reads}"

"""The shared-memory all-reduce and token-splitting overlap, run for real and checked exactly.
(The token splits and the report's arithmetic in process: tests/unit/parallel/test_token_split.py,
tests/unit/models/test_attention_metadata.py, tests/unit/bench/test_overlap_report.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.checkpoints import hf_reference, write_hf_checkpoint
from tests.support.paths import JOBS
from tests.support.processes import last_json, run


@pytest.mark.parametrize("path", ["shm", "socket"])
@pytest.mark.parametrize("nproc", [2, 3])
def test_small_collectives_job(nproc, path):
    """The shared segment and the group's own TCP links (comm/socket_links.py), each checked exactly."""
    result = run(
        [
            "dist-infer",
            "launch",
            "--nproc-per-node",
            str(nproc),
            "--",
            "python",
            str(JOBS / "shm_allreduce_job.py"),
            path,
        ],
        timeout=120,
    )
    assert result.returncode == 0
    assert result.stdout.count(f"{path} all-reduce ok") == nproc


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    path = write_hf_checkpoint(root, "llama-gqa")
    # 5 + 18 tokens: odd halves in prefill (11 / 12); decode steps of 2 tokens split 1 / 1.
    prompts = [[3, 4, 5, 6, 7], list(range(10, 28))]
    ids, logits = hf_reference(path, prompts, 6)
    single = [[9]]  # a batch of one one-token prompt: every step is one token, never split
    ids1, logits1 = hf_reference(path, single, 4)
    return path, prompts, ids, logits, single, ids1, logits1


def _generate(path, prompts, new_tokens, extra, tmp_path, launcher=None):
    dump = tmp_path / "logits.pt"
    cmd = [
        "dist-infer",
        "generate",
        "--model",
        str(path),
        "--no-eos-stop",
        "--max-new-tokens",
        str(new_tokens),
        "--json",
        "--dump-logits",
        str(dump),
        *extra,
    ]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    result = run((launcher or []) + cmd, timeout=180)
    assert result.returncode == 0
    return last_json(result.stdout), torch.load(dump)


def _assert_matches(out, logits, ref_ids, ref_logits):
    got = [o["token_ids"] for o in out["outputs"]]
    assert got == ref_ids
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "tp,overlap,shm", [(2, "on", "auto"), (2, "off", "auto"), (4, "on", "auto"), (2, "on", "off"), (3, "on", "socket")]
)
def test_overlap_exact_vs_hf(gqa, tmp_path, tp, overlap, shm):
    path, prompts, ids, logits, *_ = gqa
    out, got = _generate(path, prompts, 6, ["--tp", str(tp), "--overlap", overlap, "--shm", shm], tmp_path)
    _assert_matches(out, got, ids, logits)


def test_overlap_batch_of_one_token(gqa, tmp_path):
    path, _, _, _, single, ids1, logits1 = gqa
    out, got = _generate(path, single, 4, ["--tp", "2", "--overlap", "on"], tmp_path)
    _assert_matches(out, got, ids1, logits1)


def test_overlap_on_mpi_backend(gqa, tmp_path):
    path, prompts, ids, logits, *_ = gqa
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    out, got = _generate(path, prompts, 6, ["--tp", "2", "--overlap", "on", "--backend", "mpi"], tmp_path, mpirun)
    assert out["parallel"]["backend"] == "mpi"
    _assert_matches(out, got, ids, logits)


def test_overlap_report_json(tmp_path):
    result = run(
        [
            "dist-infer",
            "bench",
            "--tp",
            "2",
            "--batch",
            "2",
            "--prompt-len",
            "16",
            "--gen-len",
            "3",
            "--overlap-report",
            "--json",
        ],
        timeout=180,
    )
    assert result.returncode == 0
    report = last_json(result.stdout)["overlap"]
    for key in ("t_base_s", "t_overlap_s", "t_nocomm_s", "hidden_fraction"):
        assert key in report and key in report["decode"]
    assert report["t_base_s"] > 0 and report["t_nocomm_s"] > 0
    assert report["t_sequence_parallel_s"] > 0 and report["decode"]["t_sequence_parallel_s"] > 0


@pytest.mark.parametrize(
    "flags,group,has_base",
    [(["--tp", "2", "--pp", "2"], "pp", False), (["--cp", "2", "--prompt-len", "48"], "cp", True)],
)
def test_overlap_report_covers_pipeline_and_ring_transfers(flags, group, has_base):
    """Pipeline sends and ring transfers measured the same way as the tp collectives: a base
    (ring only: every transfer waited for at once), the overlapped run and the skipped one."""
    result = run(
        [
            "dist-infer",
            "bench",
            "--batch",
            "2",
            "--prompt-len",
            "16",
            "--gen-len",
            "3",
            *flags,
            "--overlap-report",
            "--timeout",
            "60",
            "--json",
        ],
        timeout=240,
    )
    assert result.returncode == 0
    report = last_json(result.stdout)["overlap"][group]
    for phase in (report, report["decode"]):
        assert phase["t_overlap_s"] > 0 and phase["t_nocomm_s"] > 0 and "exposed_s" in phase
        assert (phase["t_base_s"] is not None) == has_base
        assert (phase["hidden_fraction"] is not None) == has_base
    waits = report["waiting_s"]["overlap"][group]  # seconds inside this group's calls, by op
    assert waits and sum(waits.values()) > 0, "the transfers kept this rank waiting some time"
    assert f"{group} " in result.stdout and "exposed" in result.stdout


def test_bench_profile_splits_a_decode_step_by_kind_of_work(tmp_path):
    result = run(
        [
            "dist-infer",
            "bench",
            "--tp",
            "2",
            "--batch",
            "2",
            "--prompt-len",
            "16",
            "--gen-len",
            "4",
            "--profile",
            str(tmp_path),
            "--json",
        ],
        timeout=180,
    )
    assert result.returncode == 0
    profile = last_json(result.stdout)["profile"]
    for phase in ("prefill_s", "decode_step_s"):
        buckets = profile[phase]
        assert set(buckets) == {"gemm", "attention", "comm", "other", "python", "wall"}
        assert buckets["gemm"] > 0 and buckets["comm"] > 0 and buckets["wall"] > 0
        assert sum(v for k, v in buckets.items() if k != "wall") >= buckets["wall"] * 0.99
    table = (tmp_path / "rank0.txt").read_text()
    assert "dist_infer::skinny_linear" in table or "aten::mm" in table
    assert (tmp_path / "rank1.txt").is_file() and "decode step (ms)" in result.stdout


def test_bench_profile_splits_a_cp_prefill_per_ring_step(tmp_path):
    """Under cp=2 the prefill's ring has two steps per layer: step 0 posts the transfer of the
    other rank's K/V and attends this rank's own, step 1 attends what arrived. Every rank writes
    its own breakdown, and the flash kernel inside the ring's ranges still counts as attention."""
    result = run(
        [
            "dist-infer",
            "bench",
            "--cp",
            "2",
            "--batch",
            "1",
            "--prompt-len",
            "512",
            "--gen-len",
            "2",
            "--profile",
            str(tmp_path),
            "--json",
        ],
        timeout=180,
    )
    assert result.returncode == 0
    for rank in (0, 1):
        profile = json.loads((tmp_path / f"rank{rank}.json").read_text())
        steps = profile["prefill_ring_steps_s"]
        assert sorted(steps) == ["0", "1"], steps
        assert steps["0"]["post"] > 0 and steps["1"]["post"] == 0, "only step 0 has a next step to post"
        assert steps["0"]["wait"] > 0 and steps["1"]["wait"] == 0
        assert all(steps[s]["attend"] > 0 and steps[s]["merge"] > 0 for s in steps)
        prefill = profile["prefill_s"]
        # (counted at all: how the two clocks split a step depends on what else the cores run, so
        # a ratio between them failed under a busy suite)
        assert prefill["attention"] > 0, prefill
    assert "prefill ring step 1 (ms, all layers): post 0.0, attend" in result.stdout

"""The bench's peer runners without running them: the command lines `run_peer` starts, the prompts,
the metrics' keys, and an unknown peer refused before anything starts. (The peers themselves, run
as their own processes: tests/integration/test_peers.py.)"""

from __future__ import annotations

from dist_infer.bench.peers import PEERS, empty_metrics, make_prompts, peer_argv, run_peer

METRIC_KEYS = {"peer", "prefill_tok_s", "decode_tok_s", "ttft_s", "tpot_s", "peak_rss_mb", "tp", "ok", "error"}


def test_unknown_peer():
    m = run_peer("vllm", "/nowhere", 1, 1, 4, 2, timeout_s=5)
    assert m["ok"] is False and "unknown peer" in m["error"]


def test_argv_and_prompts():
    hf = peer_argv("hf", "/m", 2, 4, 256, 32, "/o.json", 12345)
    assert "torchrun" not in " ".join(hf) and hf[1:3] == ["-m", "dist_infer.bench.peers"]
    ds = peer_argv("deepspeed", "/m", 2, 4, 256, 32, "/o.json", 12345, threads=1)
    assert "--nproc-per-node=2" in ds and "--master-port=12345" in ds and ds[-2:] == ["--threads", "1"]
    assert set(PEERS) == {"hf", "hf-compiled", "hf-tp", "deepspeed"}
    p = make_prompts(3, 7, 50)
    assert p.shape == (3, 7) and int(p.min()) >= 3 and int(p.max()) < 50
    assert (p == make_prompts(3, 7, 50)).all()
    assert METRIC_KEYS == set(empty_metrics("hf"))


def test_variant_peers_are_refused_where_they_compare_nothing():
    from types import SimpleNamespace

    from dist_infer.bench.report import variant_refusal

    assert "without --ladder-residual" in variant_refusal(SimpleNamespace(ladder_residual="all"), "ladder")
    assert variant_refusal(SimpleNamespace(ladder_residual=None), "ladder") is None
    assert "needs --max-batched-tokens" in variant_refusal(SimpleNamespace(max_batched_tokens=None), "layered")
    assert "without --prefill-schedule layered" in variant_refusal(
        SimpleNamespace(prefill_schedule="layered", max_batched_tokens=64), "layered"
    )
    assert variant_refusal(SimpleNamespace(prefill_schedule="chunked", max_batched_tokens=64), "layered") is None


def test_the_hf_peer_runs_where_and_in_the_dtype_ours_did(tmp_path):
    """--device/--dtype reach the hf peer's command; the CPU fp32 default adds nothing; the torchrun
    peers, which run fp32 on the CPU only, refuse them before loading anything."""
    import json

    from dist_infer.bench.peers.cli import main

    assert "--device" not in peer_argv("hf", "/m", 1, 1, 8, 2, "/o.json", 1)
    hf = peer_argv("hf", "/m", 1, 1, 8, 2, "/o.json", 1, device="cuda", dtype="bfloat16")
    assert hf[-4:] == ["--device", "cuda", "--dtype", "bfloat16"]
    out = tmp_path / "o.json"
    rc = main(
        [
            "--peer",
            "deepspeed",
            "--model",
            "/m",
            "--batch",
            "1",
            "--prompt-len",
            "8",
            "--gen-len",
            "2",
            "--json-out",
            str(out),
            "--dtype",
            "bfloat16",
        ]
    )
    assert rc == 2 and "fp32 on the CPU only" in json.loads(out.read_text())["error"]

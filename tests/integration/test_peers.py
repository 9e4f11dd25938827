"""The bench's peer runners (hf, hf-tp, deepspeed) on a tiny Llama written here.

Each peer runs as its own process(es) through `run_peer`, exactly as `dist-infer bench --compare`
starts them; they must all succeed on CPU, report positive throughputs, and produce the same
greedy tokens (same weights, same prompts, fp32). (Their command lines, without running them:
tests/unit/bench/test_peer_argv.py.)
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from dist_infer.bench.peers import run_peer  # noqa: E402

BATCH, PROMPT_LEN, GEN_LEN = 2, 16, 6
TIMEOUT_S = 240  # the first deepspeed run JIT-builds its shm all-reduce op (~15-40 s), later runs reuse it
# the module's fixture runs the three peers one after another: on a machine busy with other work that
# passes the suite's 300 s per test, so the bound is the peers' own timeouts together
pytestmark = pytest.mark.timeout(3 * TIMEOUT_S + 60)
METRIC_KEYS = {"peer", "prefill_tok_s", "decode_tok_s", "ttft_s", "tpot_s", "peak_rss_mb", "tp", "ok", "error"}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=128,
        # larger than the default 0.02 so the greedy argmax has clear margins and the
        # token comparison is not at the mercy of the all-reduce's summation order
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def peer_results(tiny_llama):
    """Every peer once (they run one after another, never concurrently)."""
    out = {"hf": run_peer("hf", tiny_llama, 1, BATCH, PROMPT_LEN, GEN_LEN, timeout_s=TIMEOUT_S, repeats=2)}
    out["hf-tp"] = run_peer("hf-tp", tiny_llama, 2, BATCH, PROMPT_LEN, GEN_LEN, timeout_s=TIMEOUT_S)
    if importlib.util.find_spec("deepspeed") is not None:
        out["deepspeed"] = run_peer("deepspeed", tiny_llama, 2, BATCH, PROMPT_LEN, GEN_LEN, timeout_s=TIMEOUT_S)
    return out


def _check_ok(m: dict, peer: str, tp: int) -> None:
    assert m["ok"], f"{peer} failed: {m.get('error')}\n{m.get('stderr_tail', '')}"
    assert METRIC_KEYS <= m.keys()
    assert m["peer"] == peer and m["tp"] == tp and m["error"] is None
    for key in ("prefill_tok_s", "decode_tok_s", "ttft_s", "tpot_s", "peak_rss_mb"):
        assert m[key] is not None and m[key] > 0, (peer, key, m[key])
    ids = m["token_ids"]
    assert len(ids) == BATCH and all(len(row) == GEN_LEN for row in ids)
    assert all(0 <= t < 128 for row in ids for t in row)


def test_hf(peer_results):
    m = peer_results["hf"]
    _check_ok(m, "hf", 1)
    assert m["threads"] >= 1
    assert m["repeats"] == 2 and len(m["ttft_s_all"]) == 2 and m["ttft_s"] == min(m["ttft_s_all"])


def test_hf_tp(peer_results):
    m = peer_results["hf-tp"]
    _check_ok(m, "hf-tp", 2)
    assert m["world_size"] == 2 and m["peak_rss_mb_total"] >= m["peak_rss_mb"]


def test_deepspeed_autotp(peer_results):
    if "deepspeed" not in peer_results:
        pytest.skip("deepspeed is not installed (make peers)")
    # Runs on CPU only because the runner sets LOCAL_SIZE for DeepSpeed's shm all-reduce under torchrun;
    # without it every rank segfaults in the first forward (see dist_infer/bench/peers/runners.py).
    _check_ok(peer_results["deepspeed"], "deepspeed", 2)


def test_peers_agree_on_greedy_tokens(peer_results):
    ok = {p: m for p, m in peer_results.items() if m["ok"]}
    assert "hf" in ok and len(ok) >= 2, {p: m.get("error") for p, m in peer_results.items()}
    for peer, m in ok.items():
        assert m["token_ids"] == ok["hf"]["token_ids"], f"{peer} greedy tokens differ from hf"


def test_no_deepspeed_shm_left_behind(peer_results):
    if "deepspeed" not in peer_results:
        pytest.skip("deepspeed is not installed")
    port = peer_results["deepspeed"]["command"].split("--master-port=")[1].split()[0]
    left = [f for f in os.listdir("/dev/shm") if f.startswith("deepspeed_allreduce_buffer") and f"_{port}_" in f]
    assert not left


def test_bad_model_path_is_a_failed_result(tmp_path):
    m = run_peer("hf", str(tmp_path / "no-such-model"), 1, 1, 4, 2, timeout_s=120)
    assert m["ok"] is False and m["error"]
    assert METRIC_KEYS <= m.keys()

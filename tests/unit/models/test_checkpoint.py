"""Checkpoint reading (lazy slices, shards, errors), the embedded default model, the tokenizer.
(The default model's bytes from a separate process: tests/integration/test_tiny_model_processes.py.)"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch

from dist_infer.engine.tokenizer import TextTokenizer, TokenizerError
from dist_infer.models.checkpoint import (
    CheckpointError,
    LazyTensor,
    current_rss_mb,
    narrow,
    open_checkpoint,
    peak_rss_mb,
    source_shape,
)
from dist_infer.models.tiny_model import NAME, ensure_tiny_model
from tests.support.checkpoints import ARCHS, hf_reference, load_hf_model, write_hf_checkpoint


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("ck"), "llama-gqa")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("ck"), "llama-gqa", max_shard_size="100KB")


@pytest.fixture(scope="module")
def full_state(llama) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(llama / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


# --- lazy slices --------------------------------------------------------------------------


def test_names_config_and_metadata(llama, full_state):
    with open_checkpoint(llama) as ck:
        assert ck.path == llama
        assert ck.config["model_type"] == "llama"
        assert ck.names() == sorted(full_state)
        assert ck.has("model.embed_tokens.weight") and not ck.has("nope")
        t = ck.tensor("model.layers.0.self_attn.k_proj.weight")
        assert isinstance(t, LazyTensor)
        assert t.name == "model.layers.0.self_attn.k_proj.weight"
        assert t.shape == (32, 64) and t.dtype == torch.float32
        assert source_shape(t) == (32, 64)
        assert torch.equal(t.load(), full_state[t.name])


@pytest.mark.parametrize("name", ["model.layers.1.mlp.gate_proj.weight", "model.layers.0.self_attn.o_proj.weight"])
def test_slices_match_full_tensor(llama, full_state, name):
    full = full_state[name]
    with open_checkpoint(llama) as ck:
        t = ck.tensor(name)
        rows, cols = t.shape
        assert torch.equal(t[3:17], full[3:17])  # dim 0
        assert torch.equal(t[:, 5:29], full[:, 5:29])  # dim 1
        assert torch.equal(t[2:9, 40:], full[2:9, 40:])
        assert torch.equal(t[-4:], full[-4:])
        assert torch.equal(t[5], full[5])
        assert torch.equal(t[..., 7], full[..., 7])
        assert torch.equal(t[::2, 1:10:3], full[::2, 1:10:3])
        for dim in (0, 1):
            size = t.shape[dim]
            for start, length in ((0, size // 4), (size // 4, size // 4), (size - 8, 8)):
                expect = full.narrow(dim, start, length)
                assert torch.equal(narrow(t, dim, start, length), expect)
                assert torch.equal(narrow(full, dim, start, length), expect)
        assert torch.equal(narrow(t, -1, 0, cols), full)
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*size " + str(rows)):
            narrow(t, 0, rows - 2, 4)
        with pytest.raises(IndexError, match="out of range"):
            t[rows]


def test_in_memory_sources_match_lazy(llama):
    model = load_hf_model(llama)
    state = model.state_dict()
    with open_checkpoint(llama) as ck:
        for name in ck.names():
            assert source_shape(state[name]) == ck.tensor(name).shape
            assert torch.equal(narrow(state[name], 0, 1, 3), narrow(ck.tensor(name), 0, 1, 3))


def test_multi_shard_index(sharded, llama, full_state):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    with open_checkpoint(sharded) as ck:
        assert ck.names() == sorted(full_state)
        assert [f.name for f in ck.files] == shards
        for name in ck.names():
            t = ck.tensor(name)
            assert t.file.name == index["weight_map"][name]
            assert torch.equal(t.load(), full_state[name])
            assert torch.equal(narrow(t, 0, 0, 1), full_state[name][:1])
        assert len(ck._handles) == len(shards)  # one handle per file, not per tensor
    with pytest.raises(CheckpointError, match="closed"):
        t.load()


def test_rss_reporting():
    peak, now = peak_rss_mb(), current_rss_mb()
    assert 10 < now < 1e6 and 10 < peak < 1e6
    assert now <= peak * 1.05 + 1


# --- errors -------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_error_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nope'}.*does not exist"):
        open_checkpoint(tmp_path / "nope")


def test_error_config_missing_or_invalid(tmp_path, llama):
    ck = _copy(llama, tmp_path / "ck")
    (ck / "config.json").unlink()
    with pytest.raises(CheckpointError, match=f"{ck}.*no config.json"):
        open_checkpoint(ck)
    (ck / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 64,,\n}\n')
    with pytest.raises(CheckpointError, match=rf"{ck / 'config.json'}.*line 3, column 21"):
        open_checkpoint(ck)


def test_error_no_safetensors(tmp_path, llama):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text((llama / "config.json").read_text())
    with pytest.raises(CheckpointError, match=f"{ck}.*no safetensors"):
        open_checkpoint(ck)


def test_error_shard_missing(tmp_path, sharded):
    ck = _copy(sharded, tmp_path / "ck")
    victim = sorted(ck.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}.*missing"):
        open_checkpoint(ck)


def test_error_truncated_and_corrupt(tmp_path, llama):
    ck = _copy(llama, tmp_path / "ck")
    file = ck / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"{file}"):
        open_checkpoint(ck)
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match=f"corrupt.*{file}"):
        open_checkpoint(ck)


def test_error_index_points_to_wrong_file(tmp_path, sharded):
    ck = _copy(sharded, tmp_path / "ck")
    index_file = ck / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{name}.*{shards[1]}.*does not contain"):
        open_checkpoint(ck)


def test_error_absent_tensor(llama):
    with open_checkpoint(llama) as ck:
        with pytest.raises(CheckpointError, match=f"'model.bogus.weight'.*{llama}"):
            ck.tensor("model.bogus.weight")


# --- test helper checkpoints --------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_checkpoint_helper(tmp_path, arch):
    a = write_hf_checkpoint(tmp_path / "a", arch)
    b = write_hf_checkpoint(tmp_path / "b", arch)
    assert _digests(a) == _digests(b)
    with open_checkpoint(a) as ck:
        assert ck.has("lm_head.weight") == (arch != "llama-tied")
        if arch == "qwen2":
            assert ck.tensor("model.layers.0.self_attn.q_proj.bias").load().abs().min() > 0
        if arch == "llama31-rope":
            rope = ck.config.get("rope_parameters") or ck.config.get("rope_scaling")
            assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
        kv = 1 if arch == "llama-mqa" else 2
        assert ck.tensor("model.layers.0.self_attn.k_proj.weight").shape == (kv * 16, 64)
    ids, logits = hf_reference(a, [[1, 5, 9, 3], [1, 7]], 5)
    assert [len(x) for x in ids] == [5, 5]
    for seq, rows in zip(ids, logits):
        assert rows.shape == (5, 128)
        assert rows.argmax(-1).tolist() == seq


# --- default model ------------------------------------------------------------------------


def test_default_model_concurrent_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_INFER_CACHE", str(tmp_path))
    results, errors = [], []

    def call():
        try:
            results.append(ensure_tiny_model())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [tmp_path / NAME] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]  # no temp dirs left behind
    stamp = (tmp_path / NAME / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model() == tmp_path / NAME
    assert (tmp_path / NAME / "model.safetensors").stat().st_mtime_ns == stamp


def test_default_model_config_and_transformers(tiny_model):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_model / "config.json").read_text())
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert 900 <= tok.get_vocab_size() <= 1100
    assert cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] >= tok.get_vocab_size()
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 4
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), attn_implementation="eager").eval()
    assert model.config.vocab_size == cfg["vocab_size"] and model.dtype == torch.float32
    with open_checkpoint(tiny_model) as ck:
        assert len(ck.names()) == 2 + 4 * 9 + 1
        assert torch.equal(model.lm_head.weight, ck.tensor("lm_head.weight").load())
        assert torch.equal(ck.tensor("model.norm.weight").load(), torch.ones(256))
        std = ck.tensor("model.layers.0.mlp.up_proj.weight").load().std().item()
        assert 0.018 < std < 0.022
    ids = torch.tensor([tok.encode("The river moved east.").ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_default_tokenizer_round_trip(tiny_model):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    for text in ["The river started in the hills above the town.", "Ünïcode ✓ and tabs\tand\nnewlines  ", "x" * 50]:
        enc = tok.encode(text)
        assert tok.decode(enc.ids) == text
    common = tok.encode("the river and the town").ids
    assert len(common) <= 6  # trained merges make common words single tokens


# --- TextTokenizer ------------------------------------------------------------------------


def test_text_tokenizer(tiny_model):
    tok = TextTokenizer(tiny_model)
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    ids = tok.encode("Hello, river!")
    assert ids[0] == tok.bos_id and tok.encode("Hello, river!", add_bos=False) == ids[1:]
    assert tok.decode(ids) == "Hello, river!"
    assert tok.decode(ids + [tok.eos_id]) == "Hello, river!"
    assert tok.decode(ids, skip_special=False).startswith("<s>")
    assert tok.encode("", add_bos=True) == [tok.bos_id]


def test_text_tokenizer_ids_from_configs_then_fallback(tmp_path, tiny_model):
    ck = _copy(tiny_model, tmp_path / "ck")
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 1]}))
    tok = TextTokenizer(ck)
    assert tok.eos_id == 5 and tok.eos_ids == {5, 1} and tok.bos_id == 0
    (ck / "generation_config.json").unlink()
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["bos_token_id"], cfg["eos_token_id"]
    (ck / "config.json").write_text(json.dumps(cfg))
    tok = TextTokenizer(ck)
    assert (tok.bos_id, tok.eos_id) == (0, 1)  # from the tokenizer's <s> and </s>


def test_text_tokenizer_missing_file(tmp_path):
    with pytest.raises(TokenizerError, match=f"tokenizer.json.*{tmp_path}"):
        TextTokenizer(tmp_path)
    assert issubclass(TokenizerError, CheckpointError)


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("num_attention_heads", 0, "num_attention_heads must be a whole number"),
        ("num_key_value_heads", 0, "num_key_value_heads must be a whole number"),
        ("num_key_value_heads", 3, "not a multiple of num_key_value_heads 3"),
        ("hidden_size", 30, "hidden_size 30 is not a multiple"),
        ("max_position_embeddings", 2**40, "max_position_embeddings must be"),
        ("vocab_size", "lots", "vocab_size must be"),
    ],
)
def test_a_hostile_config_json_is_refused_naming_the_field(field, value, says):
    """The HF twin of the hostile GGUF files (models/gguf/test_gguf.py): a config.json field that would
    divide by zero or ask for terabytes."""
    from dist_infer.models.config import ModelConfig, ModelConfigError

    cfg = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
        field: value,
    }
    with pytest.raises(ModelConfigError, match=says):
        ModelConfig.from_hf(cfg, "bad/config.json")

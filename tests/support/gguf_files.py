"""Small random Llama GGUF files written the way llama.cpp's converter writes them, for the tests.

`write_llama_gguf` quantizes each matrix to the type asked for (the gguf package's own
quantizers), stores the q and k projections with llama.cpp's per-head row interleave, and writes
the llama metadata; transformers and our loader both read it back. `damaged` variants make the
bad files the loader must name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import numpy as np


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from (2 halves x d/2) to (d/2 x 2 halves)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(
    path: Union[str, Path],
    *,
    qtype: str = "Q8_0",
    hidden: int = 96,
    layers: int = 2,
    heads: int = 6,
    kv_heads: int = 3,
    intermediate: int = 160,
    vocab: int = 128,
    context: int = 256,
    tied: bool = False,
    seed: int = 0,
    rope_theta: float = 10000.0,
    eps: float = 1e-5,
    std: float = 0.1,
    int8_tensor: str = "",
) -> Path:
    """A seeded random Llama as GGUF; matrices in `qtype`, norms in F32. Same arguments, same bytes.
    `int8_tensor`: store that one tensor as I8, a type no loader dequantizes (the error test)."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    q = gguf.GGMLQuantizationType[qtype]
    d = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("test-llama")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(eps)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(d)
    w.add_file_type(int(q) if q not in (gguf.GGMLQuantizationType.F32,) else 0)

    def matrix(name: str, out_f: int, in_f: int, permute_heads: int = 0) -> None:
        m = (std * rng.standard_normal((out_f, in_f))).astype(np.float32)
        if permute_heads:
            m = llamacpp_permute(m, permute_heads)
        if name == int8_tensor:
            w.add_tensor(name, (m * 100).astype(np.int8))
        elif q in (gguf.GGMLQuantizationType.F32,):
            w.add_tensor(name, m)
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, m.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(m, q), raw_dtype=q)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", heads * d, hidden, heads)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * d, hidden, kv_heads)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * d, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * d)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QTYPES = ("Q8_0", "Q4_0", "Q4_1", "F16", "F32")


def write_qtype_files(root: Path) -> dict:
    """One file per type in QTYPES (seed 3), and "tied-Q4_1" (the LM head is the embedding)."""
    out = {qt: write_llama_gguf(root / qt / "model.gguf", qtype=qt, seed=3) for qt in QTYPES}
    out["tied-Q4_1"] = write_llama_gguf(root / "tied" / "model.gguf", qtype="Q4_1", tied=True, seed=4)
    return out

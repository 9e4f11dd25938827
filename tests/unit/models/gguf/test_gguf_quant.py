"""GGUF weights kept quantized (gguf_quant, GGUFTensor.quantized_slice) and the lean reader.

Every exactly converted type is checked against the gguf package's own dequantization, bit for
bit, on random blocks (every bit pattern of the packed integers and scales) and on blocks the gguf
package quantizes from floats, through llama.cpp's q/k row order and column shards that start on
group boundaries inside and across blocks. The types that are requantized (sub-blocks of 16)
are checked against the bound of their rounding and their reported error. The reader is checked
to give the metadata gguf's reader gives, without per-item arrays, and to refuse arrays that
claim more than the file holds.
"""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from loguru import logger

from dist_infer.models.builtin import smollm2_path
from dist_infer.models.checkpoint import CheckpointError
from dist_infer.models.gguf.checkpoint import GGUFCheckpoint, GGUFTensor, open_reader, read_field, unpermute_rows
from dist_infer.models.gguf.quant import EXACT_BITS, REQUANT_BITS, quantization_of_type, requantize
from dist_infer.models.gguf.reader import ArrayField

ROWS, COLS, HEADS = 96, 512, 6  # 512 columns: two K-quant blocks of 256, sixteen groups of 32
FP16_AT = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q6_K": (208,),
}  # where each block keeps its fp16 scales
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes as blocks of `type_name` [rows, bytes], with finite fp16 scales of both signs."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in FP16_AT[type_name]:
        raw[..., at : at + 2] = (0.01 * rng.standard_normal((rows, cols // block, 1))).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_tensors(path: Path, tensors: dict) -> Path:
    """A GGUF holding just these tensors: name -> (type name, raw blocks [rows, bytes] or float values)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (type_name, data) in tensors.items():
        if type_name in FLOAT_DTYPES:
            w.add_tensor(name, data.astype(FLOAT_DTYPES[type_name]))
        else:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tensors_of(path: Path, row_map: np.ndarray | None = None) -> dict[str, GGUFTensor]:
    return {t.name: GGUFTensor(path, t, t.name, row_map) for t in open_reader(path).tensors}


def same_bits(a: torch.Tensor, b: torch.Tensor, signed_zeros: bool = True) -> bool:
    """Equal bit for bit; signed_zeros False: once -0.0 is read as +0.0 (x + 0.0 does that and nothing else)."""
    if not signed_zeros:
        a, b = a + 0.0, b + 0.0
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf_quant")
    rng = np.random.default_rng(1)
    floats = (0.05 * rng.standard_normal((ROWS, COLS))).astype(np.float32)
    random = {t: (t, random_blocks(t, ROWS, COLS, seed=i)) for i, t in enumerate(FP16_AT)}
    quantized = {
        f"quantized.{t}": (t, gguf.quants.quantize(floats, gguf.GGMLQuantizationType[t]))
        for t in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
    }
    plain = {t: (t, floats) for t in FLOAT_DTYPES}
    return {
        "random": write_tensors(root / "random.gguf", random),
        "quantized": write_tensors(root / "quantized.gguf", quantized),
        "float": write_tensors(root / "float.gguf", plain),
    }


SLICES = [
    (slice(None), slice(None)),
    (slice(16, 80), slice(32, 100)),
    (slice(0, 1), slice(256, 512)),
    (slice(40, 96), slice(64, 288)),
    (slice(None), slice(480, 512)),
    (slice(5, 6), slice(224, 257)),
]


@pytest.mark.parametrize("type_name", sorted(EXACT_BITS))
@pytest.mark.parametrize("row_map", [False, True], ids=["rows", "qk-rows"])
def test_exact_types_convert_bit_for_bit(files, type_name, row_map):
    """Every exact type, random blocks: quantized_slice(...).dequantize() is gguf's dequantization of the
    same rows and columns (through llama.cpp's q/k row order too), the integers held in the documented
    range and bits."""
    mapped = unpermute_rows(ROWS, HEADS) if row_map else None
    t = tensors_of(files["random"], mapped)[type_name]
    assert t.quantization == quantization_of_type(type_name) == f"int{EXACT_BITS[type_name]}"
    for rows, cols in SLICES:
        w = t.quantized_slice(rows, cols)
        assert same_bits(w.dequantize(), t[rows, cols], signed_zeros=type_name != "Q4_0"), (rows, cols)
        assert (w.group_size, w.bits) == (32, EXACT_BITS[type_name])
        low, high = {"Q8_0": (-128, 127), "Q5_0": (-16, 15), "Q5_1": (0, 31), "Q5_K": (0, 31)}.get(type_name, (0, 15))
        assert low <= int(w.q.min()) and int(w.q.max()) <= high


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_blocks_quantized_by_gguf_convert_bit_for_bit(files, type_name):
    t = tensors_of(files["quantized"], unpermute_rows(ROWS, HEADS))[f"quantized.{type_name}"]
    for rows, cols in SLICES:
        assert same_bits(t.quantized_slice(rows, cols).dequantize(), t[rows, cols], type_name != "Q4_0"), (rows, cols)


def test_q4_0_differs_from_gguf_only_in_the_sign_of_zero(files):
    """The documented difference: gguf's d * (q - 8) is -0.0 where d < 0 and q = 8; ours is +0.0."""
    t = tensors_of(files["random"])["Q4_0"]
    ours, theirs = t.quantized_slice().dequantize(), t[:, :]
    assert torch.equal(ours, theirs)
    differ = ours.view(torch.int32) != theirs.view(torch.int32)
    assert differ.any() and bool((theirs[differ] == 0).all())


def test_a_column_shard_that_starts_inside_a_group_is_refused(files):
    t = tensors_of(files["random"])["Q4_1"]
    with pytest.raises(CheckpointError, match=r"columns 16\.\.64 start inside a 32-value group of Q4_1"):
        t.quantized_slice(slice(None), slice(16, 64))
    assert isinstance(CheckpointError("x"), ValueError)  # what the layers catch to read floats instead
    t[:, 16:64]  # the float path still takes it


def test_float_tensors_are_not_quantized(files):
    for t in tensors_of(files["float"]).values():
        assert t.quantized_slice() is None and t.quantization is None


@pytest.mark.parametrize("type_name", sorted(REQUANT_BITS))
def test_sub_block_types_are_requantized_within_half_a_step(files, type_name):
    """Q2_K / Q3_K / Q6_K: requantized per 32 (4 bits / 4 bits / 8 bits); each value within half a step of
    its group, the error reported once, and a shard equal to the same columns of the whole."""
    t = tensors_of(files["random"], unpermute_rows(ROWS, HEADS))[type_name]
    messages = []
    logger.enable("dist_infer")  # the library is quiet unless enabled
    sink = logger.add(messages.append, level="INFO", format="{message}")
    try:
        w = t.quantized_slice()
        t.quantized_slice(slice(0, 8), slice(64, 160))
    finally:
        logger.remove(sink)
        logger.disable("dist_infer")
    ref = t[:, :]
    bits = REQUANT_BITS[type_name]
    assert (w.bits, w.group_size, t.quantization) == (bits, 32, f"int{bits}")
    step = w.scales.repeat_interleave(32, dim=1)
    assert bool(((w.dequantize() - ref).abs() <= 0.5001 * step + 1e-12).all())
    max_abs, rel_rms = t.requantization_error
    assert 0 < max_abs <= float((0.5001 * step).max()) and 0 < rel_rms < (0.005 if bits == 8 else 0.1)
    logged = [m for m in messages if f"{type_name} ({type_name}) requantized to int{bits} per 32" in m]
    assert len(logged) == 1 and "relative RMS" in logged[0]
    shard = t.quantized_slice(slice(0, 8), slice(64, 160))
    assert torch.equal(shard.dequantize(), w.dequantize()[0:8, 64:160])


# --- requantize: pure -----------------------------------------------------------------------------------


def test_requantize_int8_is_symmetric_per_group():
    v = torch.randn(5, 70, generator=torch.Generator().manual_seed(0))  # 70: a short last group of 6
    w = requantize(v, 8, 32)
    assert (w.bits, w.group_size, w.zeros, tuple(w.scales.shape)) == (8, 32, None, (5, 3))
    assert torch.allclose(w.scales[:, 0], v[:, :32].abs().amax(dim=1) / 127)
    assert int(w.q.abs().max()) == 127
    err = (w.dequantize() - v).abs()
    assert bool((err <= 0.5001 * w.scales.repeat_interleave(32, dim=1)[:, :70]).all())


def test_requantize_int4_is_asymmetric_per_group_and_keeps_the_extremes():
    v = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    w = requantize(v, 4, 32)
    assert (w.bits, int(w.q.min()), int(w.q.max())) == (4, 0, 15)
    assert torch.equal(w.zeros, v.reshape(4, 2, 32).amin(dim=2))
    d = w.dequantize()
    for g in range(2):
        cols = slice(32 * g, 32 * g + 32)
        assert torch.allclose(d[:, cols].amax(dim=1), v[:, cols].amax(dim=1), atol=1e-6)
    assert bool(((d - v).abs() <= 0.5001 * w.scales.repeat_interleave(32, dim=1)).all())


def test_requantize_constant_groups_come_back_exactly_and_bad_arguments_are_refused():
    v = torch.tensor([[0.0] * 32 + [0.25] * 32])
    assert torch.equal(requantize(v, 8).dequantize()[:, :32], v[:, :32])
    assert torch.equal(requantize(v, 4).dequantize(), v)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        requantize(v, 3)
    with pytest.raises(ValueError, match="takes a matrix"):
        requantize(v[0], 8)


# --- the default model ----------------------------------------------------------------------------------


def test_default_model_tensors_convert_bit_for_bit():
    ck = GGUFCheckpoint(smollm2_path())
    assert ck.quantization == "int4"  # Q4_1 matrices, a Q8_0 embedding
    cases = [
        ("model.layers.0.self_attn.q_proj.weight", slice(64, 192), slice(None)),
        ("model.layers.7.self_attn.k_proj.weight", slice(None), slice(288, 576)),
        ("model.layers.3.mlp.down_proj.weight", slice(None), slice(768, 1536)),
        ("model.embed_tokens.weight", slice(1000, 1400), slice(None)),
    ]
    for name, rows, cols in cases:
        t = ck.tensor(name)
        w = t.quantized_slice(rows, cols)
        assert w.bits == (8 if t.type_name == "Q8_0" else 4)
        assert same_bits(w.dequantize(), t[rows, cols]), name
    assert ck.tensor("model.norm.weight").quantized_slice() is None
    assert ck.requantization_report() is None


def test_checkpoint_reports_its_dominant_quantization_and_requantization(tmp_path):
    """A Q4_K_M-like file: Q4_K matrices, Q6_K for v and down; `quantization` says int4, and the report
    names what was requantized."""
    h, ff, vocab = 256, 512, 64
    f = np.random.default_rng(2).standard_normal
    t = {
        "token_embd.weight": (
            "Q8_0",
            gguf.quants.quantize((0.1 * f((vocab, h))).astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
        ),
        "output_norm.weight": ("F32", np.ones(h)),
        "blk.0.attn_norm.weight": ("F32", np.ones(h)),
        "blk.0.ffn_norm.weight": ("F32", np.ones(h)),
    }
    shapes = {
        "attn_q": (h, h),
        "attn_k": (128, h),
        "attn_v": (128, h),
        "attn_output": (h, h),
        "ffn_gate": (ff, h),
        "ffn_up": (ff, h),
        "ffn_down": (h, ff),
    }
    for i, (n, (rows, cols)) in enumerate(shapes.items()):
        qt = "Q6_K" if n in ("attn_v", "ffn_down") else "Q4_K"
        t[f"blk.0.{n}.weight"] = (qt, random_blocks(qt, rows, cols, seed=10 + i))
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (w.add_block_count, 1),
        (w.add_context_length, 64),
        (w.add_embedding_length, h),
        (w.add_feed_forward_length, ff),
        (w.add_head_count, 4),
        (w.add_head_count_kv, 2),
        (w.add_vocab_size, vocab),
    ]:
        add(value)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    for name, (qt, data) in t.items():
        w.add_tensor(
            name,
            data.astype(np.float32) if qt == "F32" else data,
            raw_dtype=None if qt == "F32" else gguf.GGMLQuantizationType[qt],
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ck = GGUFCheckpoint(path)
    assert ck.quantization == "int4"
    assert ck.tensor("model.layers.0.self_attn.q_proj.weight").quantized_slice().bits == 4  # Q4_K: exact
    assert ck.tensor("model.layers.0.mlp.down_proj.weight").quantized_slice(slice(0, 64)).bits == 8  # Q6_K
    report = ck.requantization_report()
    assert re.match(
        r"1 tensors requantized per 32 values: largest abs error \S+, largest relative RMS error \S+ "
        r"\(blk\.0\.ffn_down\.weight\)",
        report,
    ), report


# --- the lean reader ------------------------------------------------------------------------------------


def test_reader_gives_gguf_metadata_without_per_item_arrays():
    """Every metadata field reads as gguf's own reader reads it; the vocabulary arrays stay undecoded
    (ArrayFields) until asked, and opening the file allocates little."""
    path = smollm2_path()
    tracemalloc.start()
    try:
        ours = open_reader(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"opening the default model allocated {peak / 2**20:.0f} MiB"
    assert isinstance(ours.fields["tokenizer.ggml.tokens"], ArrayField)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    theirs = gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert read_field(ours, key) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]


def _array_file(tmp_path: Path) -> Path:
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("test.strings", ["a", "bc", "déf"])
    w.add_array("test.numbers", [1, 2, 3])
    w.add_tensor("x", np.zeros(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    "part,value,error",
    [
        (4, 2**40, r"metadata array test\.strings claims 1099511627776 items"),
        (5, 2**40, r"test\.strings: item 0 claims 1099511627776 bytes"),
    ],
)
def test_reader_refuses_arrays_that_claim_more_than_the_file(tmp_path, part, value, error):
    path = _array_file(tmp_path)
    assert read_field(open_reader(path), "test.strings") == ["a", "bc", "déf"]
    assert read_field(open_reader(path), "test.numbers") == [1, 2, 3]
    reader = gguf.GGUFReader(str(path), "r+")  # parts: key length, key, type, item type, count, first length, ...
    reader.fields["test.strings"].parts[part][0] = value
    reader.data.flush()
    del reader
    with pytest.raises(CheckpointError, match=error):
        open_reader(path)

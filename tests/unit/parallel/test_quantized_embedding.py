"""An embedding held quantized: its lookups are exactly the dequantized table's rows (over
vocabulary shards, ids outside a rank's shard masked), a tied LM head computes with the very same
integers (no float table anywhere), and whole tied models, ranks as threads, equal transformers
running the dequantized tied table: from HF weights (int8, int4) and from a GGUF file (auto, whose
blocks convert exactly, so HF's own GGUF dequantization is the reference)."""

from __future__ import annotations

from itertools import chain

import pytest
import torch
import torch.nn.functional as F
from checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from gguf_files import write_llama_gguf
from quantized_reference import dequantize_hf_model
from threads import run_ranks, thread_groups

from dist_infer.kernels import load_cpu_kernels
from dist_infer.parallel.embedding import VocabParallelEmbedding
from dist_infer.parallel.quantized import QuantizedWeight, quantize_int4, quantize_int8
from dist_infer.parallel.quantized_linear import (
    GroupQuantLinear,
    Int4Linear,
    Int8Linear,
    pack_block,
    pack_lookup,
    pack_tied,
    quantize_as,
)

NATIVE = load_cpu_kernels()
needs_native = pytest.mark.skipif(NATIVE is None, reason="no C compiler: the native CPU kernels are not built")
PROMPTS = [[5, 9, 17, 3, 44], [7, 11] * 6, [120, 64, 63, 127]]  # ids of both halves of the vocabulary


def _w(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1


def _tables() -> dict[str, QuantizedWeight]:
    d = torch.rand(100, 2, generator=torch.Generator().manual_seed(3)) * 0.01
    return {"int8 per row": quantize_int8(_w(100, 64)), "int8 g32 (Q8_0)": quantize_int8(_w(100, 64), 32),
            "int4 g32": quantize_int4(_w(100, 64)),
            "Q4_0": QuantizedWeight(torch.randint(0, 16, (100, 64), dtype=torch.int8), d, -8 * d, 32, 4)}


@pytest.mark.parametrize("name", list(_tables()))
def test_lookup_is_exactly_the_dequantized_rows(name):
    """GroupQuantLinear (the lookup table, and the native head's form) and Int8Linear (torch's
    int8 head, which a tied embedding reads too) give the dequantized table's rows bit for bit."""
    qw = _tables()[name]
    ids = torch.tensor([[0, 99, 5], [5, 42, 17]])
    want = F.embedding(ids, qw.dequantize())
    forms = [pack_lookup(qw, torch.float32, name), pack_block(qw, torch.float32, name, native=True)]
    forms += [m for m in [pack_block(qw, torch.float32, name)] if isinstance(m, Int8Linear)]
    for m in forms:
        assert isinstance(m, (GroupQuantLinear, Int8Linear)), type(m)
        assert torch.equal(m.lookup(ids), want), type(m)


def test_tied_forms_share_what_can_be_looked_up():
    int8, int4 = quantize_int8(_w(100, 64)), quantize_int4(_w(100, 64))
    table, head = pack_tied(int8, torch.float32, "t")
    assert table is head and isinstance(head, Int8Linear)
    table, head = pack_tied(int4, torch.float32, "t", native=True)
    assert table is head and isinstance(head, GroupQuantLinear)
    table, head = pack_tied(int4, torch.float32, "t")  # torch's int4 packing cannot be indexed
    assert isinstance(head, Int4Linear) and isinstance(table, GroupQuantLinear)


class BlocksSource:
    """A float table that also hands out its exact quantized blocks by rows (a GGUF tensor's way)."""

    def __init__(self, qw: QuantizedWeight):
        self.qw, self.shape = qw, qw.shape

    def quantized_slice(self, rows: slice, cols: slice) -> QuantizedWeight:
        r0, r1, _ = rows.indices(self.shape[0])
        assert cols == slice(None)
        return self.qw.narrow(0, r0, r1 - r0)

    def __getitem__(self, index):
        return self.qw.dequantize()[index]


@pytest.mark.parametrize("scheme", ["auto", "int8", "int4"])
def test_vocab_parallel_embedding_looks_up_quantized_rows(scheme):
    """vocab 100 over tp=3: shards of 34 rows (the last 32 valid + 2 padding); ids of every shard.
    Each rank masks the ids outside its range to zero rows; the sum over ranks is exactly the
    dequantized table's rows."""
    w = _w(100, 64)
    if scheme == "auto":  # a source's own blocks, kept as they are
        qw = QuantizedWeight(torch.randint(0, 16, (100, 64), dtype=torch.int8), torch.rand(100, 2) * 0.01,
                             torch.rand(100, 2) * -0.05, 32, 4)  # Q4_1-like
        source, table = BlocksSource(qw), qw.dequantize()
    else:  # each rank quantizes its own rows: rows are independent, so the table as a whole is the same
        source, table = w, quantize_as(w, scheme).dequantize()
    ids = torch.tensor([0, 33, 34, 67, 68, 99, 5, 99, 34])

    def body(g):
        embed = VocabParallelEmbedding(100, 64, g.tp)
        embed.set_quantization(scheme)
        embed.weight_loader(source)
        assert embed.weight is None and isinstance(embed.quantized, GroupQuantLinear)
        assert embed.quantized.q.shape[0] == embed.local
        return embed(ids)

    for out in run_ranks(thread_groups(3, 1), body):
        assert torch.equal(out, F.embedding(ids, table))


def _float_tables(stage) -> list[str]:
    """Floating-point tensors of the embedding and the LM head of `stage` past a quarter of a float
    vocabulary shard (their scales and zeros are a 32nd of it each)."""
    found = []
    for module in (stage.embed_tokens, stage.lm_head):
        size = module.local * module.hidden // 4
        found += [f"{module.name}.{n}" for n, t in chain(module.named_parameters(), module.named_buffers())
                  if t.is_floating_point() and t.numel() >= size]
    return found


@pytest.mark.parametrize("scheme,native", [("int8", True), ("int4", True), ("int8", False), ("int4", False)])
def test_tied_head_and_embedding_hold_one_quantized_table(scheme, native, tmp_path):
    """int8 / int4 on a tied model: the table is quantized once; the head computes with the
    embedding's own module (beside torch's int4 form, the embedding keeps the integers unpacked
    for lookups), and no float table is allocated."""
    if native and NATIVE is None:
        pytest.skip("no C compiler: the native CPU kernels are not built")
    from dist_infer.models.loader import stage_from_hf_model

    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-tied"))
    stage = stage_from_hf_model(hf, thread_groups(1, 1)[0], quantization=scheme, native_kernels=native)
    embed, head = stage.embed_tokens, stage.lm_head
    assert embed.weight is None and head.weight is None
    if native or scheme == "int8":
        assert head.quantized is embed.quantized
        assert isinstance(head.quantized, GroupQuantLinear if native else Int8Linear)
    else:
        assert isinstance(head.quantized, Int4Linear) and isinstance(embed.quantized, GroupQuantLinear)
    assert _float_tables(stage) == []


@pytest.mark.parametrize("scheme,native", [("int8", True), ("int4", True), ("int8", False), ("int4", False)])
def test_tied_model_over_threads_equals_hf_on_the_dequantized_tied_table(scheme, native, tmp_path):
    """tp=2 (each rank its half of the vocabulary): greedy ids equal, logits within fp32 tolerance of
    transformers with the tied table (both ends) and every linear replaced by its dequantized value."""
    if native and NATIVE is None:
        pytest.skip("no C compiler: the native CPU kernels are not built")
    from dist_infer.engine.engine_core import Engine
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.models.loader import stage_from_hf_model

    hf = load_hf_model(write_hf_checkpoint(tmp_path, "llama-tied"))

    def body(g):
        stage = stage_from_hf_model(hf, g, quantization=scheme, native_kernels=native)
        assert stage.embed_tokens.weight is None and stage.lm_head.quantized is not None
        return Engine(stage, g).generate(PROMPTS, SamplingParams(max_new_tokens=4, stop_at_eos=False),
                                         return_logits=True)

    results = run_ranks(thread_groups(2, 1), body)
    ref_ids, ref_logits = hf_reference(None, PROMPTS, 4, model=dequantize_hf_model(hf, scheme, tp=2))
    for outputs in results:
        for b, out in enumerate(outputs):
            assert out.token_ids == ref_ids[b]
            torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype,native", [("Q8_0", True), ("Q4_1", True), ("Q4_1", False), ("Q8_0", False)])
def test_tied_gguf_auto_keeps_the_files_table_and_equals_hf(qtype, native, tmp_path):
    """--quantization auto on a tied GGUF whose table converts exactly: the embedding and the head
    hold the file's blocks (shared where the head's form can be indexed; Q8_0 without the native
    kernels has no int kernel and is one float table, exact), and tp=2 equals transformers loading
    the same file (it dequantizes to the same fp32 values)."""
    if native and NATIVE is None:
        pytest.skip("no C compiler: the native CPU kernels are not built")
    from dist_infer.engine.engine_core import Engine
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.models.loader import load_stage

    path = write_llama_gguf(tmp_path / "tied.gguf", qtype=qtype, tied=True, seed=5)

    def body(g):
        stage = load_stage(path, g, quantization="auto", native_kernels=native)[0]
        embed, head = stage.embed_tokens, stage.lm_head
        if qtype == "Q8_0" and not native:
            assert embed.quantized is None and head.weight is embed.weight
        else:
            assert embed.weight is None and head.weight is None and _float_tables(stage) == []
            assert (head.quantized is embed.quantized) == native
        return Engine(stage, g).generate(PROMPTS, SamplingParams(max_new_tokens=4, stop_at_eos=False),
                                         return_logits=True)

    results = run_ranks(thread_groups(2, 1), body)
    ref_ids, ref_logits = hf_reference(path, PROMPTS, 4)
    for outputs in results:
        for b, out in enumerate(outputs):
            assert out.token_ids == ref_ids[b]
            torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=2e-4, rtol=1e-4)


def test_api_load_and_shard_take_quantization(tmp_path):
    """dist_infer.load / dist_infer.shard pass `quantization` through with the CLI's default, auto: a
    GGUF file stays quantized (and generates like transformers on it), an in-memory HF model loads as
    floats; 'none' and 'int4' are taken as given."""
    from dist_infer.engine.api import load, shard

    g = thread_groups(1, 1)[0]
    gguf = write_llama_gguf(tmp_path / "tied.gguf", qtype="Q8_0", tied=True, seed=5)
    hf = load_hf_model(write_hf_checkpoint(tmp_path / "hf", "llama-tied"))

    def quantized(model) -> int:
        return sum(getattr(m, "quantized", None) is not None for m in model.engine.stage.modules())

    auto = load(gguf, groups=g)
    assert quantized(auto) > 0 and auto.engine.stage.embed_tokens.weight is None
    assert quantized(load(gguf, groups=g, quantization="none")) == 0
    assert quantized(shard(hf, groups=g)) == 0
    assert quantized(shard(hf, groups=g, quantization="int4")) > 0
    ref_ids, ref_logits = hf_reference(gguf, PROMPTS, 4)
    for b, out in enumerate(auto.generate(PROMPTS, max_new_tokens=4, return_logits=True)):
        assert out.token_ids == ref_ids[b]
        torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=2e-4, rtol=1e-4)

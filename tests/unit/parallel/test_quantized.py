"""Weight-only quantization: the pure quantize/dequantize functions, each kernel path against
`x @ qw.dequantize().T`, the layers loaded quantized against plain layers holding the dequantized
weights, the fallbacks, and a whole tp=2 model (ranks as threads) against transformers running
the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from checkpoints import hf_reference, load_hf_model, write_hf_checkpoint
from quantized_reference import dequantize_hf_model
from threads import run_ranks, thread_groups

from dist_infer.kernels import load_cpu_kernels
from dist_infer.models.loader import resolve_quantization
from dist_infer.parallel.embedding import ParallelLMHead
from dist_infer.parallel.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from dist_infer.parallel.quantized import QuantizedWeight, quantize_int4, quantize_int8, stack_rows
from dist_infer.parallel.quantized_linear import (
    FloatLinear,
    GroupQuantLinear,
    Int4Linear,
    Int8Linear,
    QuantizationError,
    pack_block,
    quantize_as,
)


def _w(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.1


def _x(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(99))


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    scale = want.abs().max().clamp_min(1e-6)
    assert (got - want).abs().max() / scale < rtol, float((got - want).abs().max() / scale)


# -- quantize / dequantize ----------------------------------------------------------------------------

@pytest.mark.parametrize("group", [None, 32])
def test_int8_round_trip_within_half_a_step(group):
    w = _w(24, 80)
    qw = quantize_int8(w, group)
    assert qw.bits == 8 and qw.zeros is None and qw.q.dtype == torch.int8
    assert int(qw.q.abs().max()) <= 127
    step = qw.scales.repeat_interleave(qw.group_size, dim=1)[:, :80]
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert qw.scales.shape == ((24, 1) if group is None else (24, 3))  # a last partial group of 16


@pytest.mark.parametrize("group", [32, 64])
def test_int4_round_trip_within_half_a_step_extremes_exact(group):
    w = _w(16, 128, seed=1)
    qw = quantize_int4(w, group)
    assert qw.bits == 4 and 0 <= int(qw.q.min()) and int(qw.q.max()) <= 15
    deq = qw.dequantize()
    step = qw.scales.repeat_interleave(group, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    g = w.reshape(16, -1, group)
    torch.testing.assert_close(deq.reshape(16, -1, group).amin(2), g.amin(2), rtol=0, atol=1e-6)
    torch.testing.assert_close(deq.reshape(16, -1, group).amax(2), g.amax(2), rtol=0, atol=1e-6)


def test_constant_and_zero_rows_are_exact():
    w = torch.zeros(2, 64)
    w[1] = 0.25
    for qw in (quantize_int8(w), quantize_int4(w)):
        torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=0)


def test_narrow_rows_and_whole_groups_of_columns():
    qw = quantize_int4(_w(8, 128), 32)
    torch.testing.assert_close(qw.narrow(0, 2, 3).dequantize(), qw.dequantize()[2:5])
    torch.testing.assert_close(qw.narrow(1, 32, 64).dequantize(), qw.dequantize()[:, 32:96])
    with pytest.raises(ValueError, match="cut a group"):
        qw.narrow(1, 16, 32)


def test_signed_4bit_and_stacking():
    """A source's signed -8..7 blocks (zeros None) stack with unsigned ones; values unchanged."""
    signed = QuantizedWeight(torch.randint(-8, 8, (4, 64), dtype=torch.int8), torch.rand(4, 2), None, 32, 4)
    unsigned = quantize_int4(_w(4, 64))
    stacked = stack_rows([signed, unsigned])
    assert int(stacked.q.min()) >= 0
    torch.testing.assert_close(stacked.dequantize(), torch.cat([signed.dequantize(), unsigned.dequantize()]))
    assert stack_rows([quantize_int4(_w(4, 64), 32), quantize_int4(_w(4, 64), 64)]) is None


# -- kernels ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, 5])
def test_int8_kernel_equals_dequantized_product(rows):
    qw = quantize_int8(_w(40, 96))
    m = pack_block(qw, torch.float32, "t")
    assert isinstance(m, Int8Linear)
    _close(m(_x(rows, 96)), _x(rows, 96) @ qw.dequantize().T)


@pytest.mark.parametrize("out,group", [(48, 32), (40, 64), (16, 128)])  # 40: rows padded to 48
def test_int4_kernel_equals_dequantized_product(out, group):
    qw = quantize_int4(_w(out, 256), group)
    m = pack_block(qw, torch.float32, "t")
    assert isinstance(m, Int4Linear)
    for rows in (1, 3):
        _close(m(_x(rows, 256)), _x(rows, 256) @ qw.dequantize().T, rtol=1e-4)


def test_int4_kernel_takes_gguf_style_blocks():
    """Q4_0 (q 0..15, zeros -8d) and a signed source: both exact through the (q - 8) * s + z kernel."""
    d = torch.rand(32, 4) * 0.01
    q4_0 = QuantizedWeight(torch.randint(0, 16, (32, 128), dtype=torch.int8), d, -8 * d, 32, 4)
    signed = QuantizedWeight(torch.randint(-8, 8, (32, 128), dtype=torch.int8), d, None, 32, 4)
    for qw in (q4_0, signed):
        _close(pack_block(qw, torch.float32, "t")(_x(2, 128)), _x(2, 128) @ qw.dequantize().T, rtol=1e-4)


def test_bfloat16_kernels():
    x = _x(2, 128).bfloat16()
    for qw in (quantize_int8(_w(32, 128)), quantize_int4(_w(32, 128))):
        got = pack_block(qw, torch.bfloat16, "t")(x)
        assert got.dtype == torch.bfloat16
        _close(got.float(), x.float() @ qw.dequantize().T, rtol=2e-2)


NATIVE = load_cpu_kernels()
needs_native = pytest.mark.skipif(NATIVE is None, reason="no C compiler: the native CPU kernels are not built")


def _gguf_like() -> dict[str, QuantizedWeight]:
    d = torch.rand(200, 6, generator=torch.Generator().manual_seed(3)) * 0.01
    return {"int8 per channel": quantize_int8(_w(200, 192)), "int8 g32 (Q8_0)": quantize_int8(_w(200, 192), 32),
            "int4 g32": quantize_int4(_w(200, 192)), "int4 g64": quantize_int4(_w(200, 192), 64),
            "Q4_0": QuantizedWeight(torch.randint(0, 16, (200, 192), dtype=torch.int8), d, -8 * d, 32, 4),
            "signed 4-bit": QuantizedWeight(torch.randint(-8, 8, (200, 192), dtype=torch.int8), d, None, 32, 4)}


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 20, 70])  # one native call, tiles of 8, dequantized blocks
def test_group_quant_linear_equals_dequantized_product(native, rows):
    """The native quant_linear (any group of a multiple of 32, zeros or not, 4-bit packed) and its
    torch path (blocks of rows dequantized)."""
    x = _x(rows, 192)
    for name, qw in _gguf_like().items():
        m = pack_block(qw, torch.float32, name, native=True)
        assert isinstance(m, GroupQuantLinear), name
        _close(m(x, NATIVE if native else None), x @ qw.dequantize().T)


def test_no_kernel_falls_back_to_the_dequantized_weight():
    """Group-wise int8 (GGUF Q8_0), 4-bit groups of 16, columns not in whole groups: float, exact."""
    cases = [quantize_int8(_w(16, 64), 32), quantize_int4(_w(16, 64), 16), quantize_int4(_w(16, 80), 32)]
    for qw in cases:
        m = pack_block(qw, torch.float32, "t")
        assert isinstance(m, FloatLinear)
        torch.testing.assert_close(m.weight, qw.dequantize())


# -- layers -------------------------------------------------------------------------------------------

def _tp(size: int, rank: int):
    return thread_groups(size, 1)[rank].tp


def _loaded(layer, loads, scheme=None, kernels=None):
    layer.kernels = kernels
    if scheme:
        layer.set_quantization(scheme)
    for args in loads:
        layer.weight_loader(*args)
    return layer


def _quantized_params_are_gone(layer) -> None:
    assert layer.weight is None and layer.quantized is not None
    assert [n for n, _ in layer.named_parameters()] in ([], ["bias"])


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rank", [0, 1])
def test_column_merged_qkv_layers_equal_dequantized_plain_layers(scheme, rank, native):
    tp = _tp(2, rank)
    H, x = 64, _x(3, 64)
    weights = {name: _w(n, H, seed=s) for s, (name, n) in enumerate({"up": 96, "gate": 96, "q": 64, "k": 32,
                                                                      "v": 32}.items())}
    deq = {name: quantize_as(t, scheme).dequantize() for name, t in weights.items()}
    builds = [
        (lambda: ColumnParallelLinear(H, 96, tp, bias=True), lambda w: [(w["up"],), (torch.ones(96), "bias")]),
        (lambda: MergedColumnParallelLinear(H, [96, 96], tp), lambda w: [(w["gate"], 0), (w["up"], 1)]),
        (lambda: QKVParallelLinear(H, 16, 4, 2, tp), lambda w: [(w["q"], "q"), (w["k"], "k"), (w["v"], "v")]),
    ]
    for make, loads in builds:
        quant = _loaded(make(), loads(weights), scheme, NATIVE if native else None)
        plain = _loaded(make(), loads(deq))
        _quantized_params_are_gone(quant)
        assert isinstance(quant.quantized, GroupQuantLinear if native else (Int8Linear, Int4Linear))
        got, want = quant(x), plain(x)
        for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want],
                        strict=True):
            _close(g, w, rtol=1e-4)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_row_parallel_quantizes_its_own_column_shard(scheme, native):
    w, x = _w(48, 128), _x(2, 128)
    for rank in (0, 1):
        layer = _loaded(RowParallelLinear(128, 48, _tp(2, rank)), [(w,)], scheme, NATIVE if native else None)
        _quantized_params_are_gone(layer)
        shard = w[:, 64 * rank:64 * (rank + 1)]
        _close(layer.partial(x[:, 64 * rank:64 * (rank + 1)]),
               x[:, 64 * rank:64 * (rank + 1)] @ quantize_as(shard, scheme).dequantize().T, rtol=1e-4)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_lm_head_quantized_with_padded_vocabulary(scheme, native):
    """vocab 100 over tp=3: shards of 34 rows, the last with 32 valid and 2 padding rows (logits 0)."""
    w, x = _w(100, 64), _x(2, 64)
    deq = quantize_as(w, scheme).dequantize()
    for rank in range(3):
        head = _loaded(ParallelLMHead(100, 64, _tp(3, rank)), [(w,)], scheme, NATIVE if native else None)
        plain = _loaded(ParallelLMHead(100, 64, _tp(3, rank)), [(deq,)])
        _quantized_params_are_gone(head)
        _close(head._matmul(x, None), plain._matmul(x, None), rtol=1e-4)


class FakeQuantizedSource:
    """A float weight that also hands out its exact quantized blocks (what a GGUF tensor does),
    refusing slices that cut a group, and logging what it was asked for."""

    def __init__(self, qw: QuantizedWeight):
        self.qw, self.shape, self.asked = qw, qw.shape, []

    def quantized_slice(self, rows: slice, cols: slice) -> QuantizedWeight:
        self.asked.append(("quantized", rows, cols))
        r0, r1, _ = rows.indices(self.shape[0])
        c0, c1, _ = cols.indices(self.shape[1])
        return self.qw.narrow(0, r0, r1 - r0).narrow(1, c0, c1 - c0)

    def __getitem__(self, index):
        self.asked.append(("float",) + tuple(index))
        return self.qw.dequantize()[index]


def test_auto_keeps_a_sources_blocks_and_reads_only_the_shard():
    qw = QuantizedWeight(torch.randint(0, 16, (64, 64), dtype=torch.int8), torch.rand(64, 2) * 0.01,
                         torch.rand(64, 2) * -0.05, 32, 4)  # Q4_1-like
    src = FakeQuantizedSource(qw)
    layer = _loaded(ColumnParallelLinear(64, 64, _tp(2, 1)), [(src,)], "auto")
    assert isinstance(layer.quantized, Int4Linear)
    assert src.asked == [("quantized", slice(32, 64), slice(None))]
    _close(layer(_x(2, 64)), _x(2, 64) @ qw.dequantize()[32:].T, rtol=1e-4)


def test_auto_row_shard_cutting_a_group_falls_back_to_floats():
    """in 96 over tp=2: rank 1's columns start at 48, inside a group of 32: read as exact floats."""
    qw = quantize_int4(_w(32, 96), 32)
    layer = _loaded(RowParallelLinear(96, 32, _tp(2, 1)), [(FakeQuantizedSource(qw),)], "auto")
    assert layer.quantized is None and layer.weight is not None
    torch.testing.assert_close(layer.weight.data, qw.dequantize()[:, 48:])


@needs_native
def test_auto_keeps_group_wise_int8_with_native_kernels():
    qw = quantize_int8(_w(32, 64), 32)  # GGUF Q8_0's layout
    layer = _loaded(ColumnParallelLinear(64, 32, _tp(1, 0)), [(FakeQuantizedSource(qw),)], "auto", NATIVE)
    assert isinstance(layer.quantized, GroupQuantLinear) and layer.weight is None
    _close(layer(_x(2, 64)), _x(2, 64) @ qw.dequantize().T)


def test_auto_group_wise_int8_is_exact_as_floats_and_int8_requantizes_per_channel():
    """Without the native kernels: group-wise int8 has no torch kernel (floats, exact); int8
    requantizes it per output channel for torch's."""
    qw = quantize_int8(_w(32, 64), 32)  # GGUF Q8_0's layout
    auto = _loaded(ColumnParallelLinear(64, 32, _tp(1, 0)), [(FakeQuantizedSource(qw),)], "auto")
    torch.testing.assert_close(auto.weight.data, qw.dequantize())
    int8 = _loaded(ColumnParallelLinear(64, 32, _tp(1, 0)), [(FakeQuantizedSource(qw),)], "int8")
    assert isinstance(int8.quantized, Int8Linear)
    _close(int8(_x(2, 64)), _x(2, 64) @ quantize_int8(qw.dequantize()).dequantize().T)


def test_resolve_quantization():
    assert resolve_quantization("auto", gguf=False, device=None) == "none"
    assert resolve_quantization("auto", gguf=True, device=torch.device("cpu")) == "auto"
    assert resolve_quantization("int4", gguf=False, device=None) == "int4"
    with pytest.raises(QuantizationError, match="CPU only"):
        resolve_quantization("int8", gguf=False, device=torch.device("cuda", 0))
    with pytest.raises(QuantizationError, match="one of"):
        resolve_quantization("fp8", gguf=False, device=None)


# -- whole models, ranks as threads, against transformers on the dequantized weights -----------------

@pytest.mark.parametrize("arch,scheme,tp,ep,native", [
    ("llama-gqa", "int8", 2, 1, True), ("llama-gqa", "int8", 2, 1, False), ("qwen2", "int4", 2, 1, True),
    ("qwen2", "int4", 2, 1, False), ("mixtral", "int8", 1, 2, True),
    ("qwen3-moe", "int4", 2, 1, True), ("qwen3-moe", "int8", 2, 1, False), ("mixtral", "int4", 2, 1, "disk")])
def test_model_over_threads_equals_hf_on_dequantized_weights(arch, scheme, tp, ep, native, tmp_path):
    """native "disk": load_stage from the checkpoint's files (per-expert tensors, lazily sliced),
    the others from transformers' in-memory model (fused experts). Tied models:
    test_quantized_embedding.py."""
    if native and NATIVE is None:
        pytest.skip("no C compiler: the native CPU kernels are not built")
    from dist_infer.engine.engine_core import Engine
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.models.loader import load_stage, stage_from_hf_model

    overrides = {"intermediate_size": 256} if arch == "mixtral" else {}  # 128 per rank: whole int4 groups
    path = write_hf_checkpoint(tmp_path, arch, **overrides)
    hf = load_hf_model(path)
    prompts = [[5, 9, 17, 3, 44], [7, 11] * 6]

    def body(g):
        if native == "disk":
            stage = load_stage(path, g, quantization=scheme)[0]
        else:
            stage = stage_from_hf_model(hf, g, quantization=scheme, native_kernels=native)
        kinds = GroupQuantLinear if native else (Int8Linear, Int4Linear)
        quantized = sum(isinstance(m, kinds) for m in stage.modules())
        params = SamplingParams(max_new_tokens=4, stop_at_eos=False)
        outs = Engine(stage, g).generate(prompts, params, return_logits=True)
        return outs, quantized

    results = run_ranks(thread_groups(tp, ep), body)
    ref_ids, ref_logits = hf_reference(None, prompts, 4, model=dequantize_hf_model(hf, scheme, tp))
    for outputs, quantized in results:
        assert quantized > 0
        for b, out in enumerate(outputs):
            assert out.token_ids == ref_ids[b]
            torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_quantization_flag_beside_dtype(command):
    from dist_infer.cli.parser import build_parser

    parser = build_parser()
    assert parser.parse_args([command]).quantization == "auto"
    assert parser.parse_args([command, "--quantization", "int4"]).quantization == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--quantization", "fp8"])

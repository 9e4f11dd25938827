"""The vocabulary-parallel embedding and LM head held quantized: the head over a padded vocabulary
against a plain head on the dequantized weight, and the embedding's lookups (vocab 100 over tp=3,
ranks as threads) exactly the dequantized table's rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dist_infer.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from dist_infer.parallel.quantized import QuantizedWeight
from dist_infer.parallel.quantized_linear import GroupQuantLinear, quantize_as
from tests.support.quantized_helpers import (
    NATIVE,
    assert_close_relative,
    assert_quantized_params_gone,
    load_layer,
    needs_native,
    rand_input,
    rand_weight,
    tp_group,
)
from tests.support.threads import run_ranks, thread_groups


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_lm_head_quantized_with_padded_vocabulary(scheme, native):
    """vocab 100 over tp=3: shards of 34 rows, the last with 32 valid and 2 padding rows (logits 0)."""
    w, x = rand_weight(100, 64), rand_input(2, 64)
    deq = quantize_as(w, scheme).dequantize()
    for rank in range(3):
        head = load_layer(ParallelLMHead(100, 64, tp_group(3, rank)), [(w,)], scheme, NATIVE if native else None)
        plain = load_layer(ParallelLMHead(100, 64, tp_group(3, rank)), [(deq,)])
        assert_quantized_params_gone(head)
        assert_close_relative(head._matmul(x, None), plain._matmul(x, None), rtol=1e-4)


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
    w = rand_weight(100, 64)
    if scheme == "auto":  # a source's own blocks, kept as they are
        qw = QuantizedWeight(
            torch.randint(0, 16, (100, 64), dtype=torch.int8),
            torch.rand(100, 2) * 0.01,
            torch.rand(100, 2) * -0.05,
            32,
            4,
        )  # Q4_1-like
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

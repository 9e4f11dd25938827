"""Vocabulary-parallel embedding and LM head: each tp rank owns a contiguous vocabulary range
(padded when tp does not divide the vocabulary).

Either may hold its shard quantized (`set_quantization`). The embedding then looks its rows up
from the integers (only the rows of the step's ids are dequantized, to the values the float
table would hold), and an LM head tied to it computes with the very same packed module: one copy
of the vocabulary for both, and no float table.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dist_infer.comm.base import Communicator
from dist_infer.parallel.linear import QuantizableWeight
from dist_infer.parallel.quantized_linear import FloatLinear, check_scheme, pack_lookup, pack_tied, read_block
from dist_infer.parallel.sharding import padded_shard_range
from dist_infer.parallel.tp_comm import gather_from_tp, reduce_from_tp
from dist_infer.parallel.weights import check_shape, copy_into, narrow


class _VocabShard(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: Communicator, dtype: torch.dtype, name: str):
        super().__init__()
        self.tp, self.name = tp, name
        self.vocab, self.hidden = vocab, hidden
        self.start, self.local, self.valid = padded_shard_range(vocab, tp.size, tp.rank)
        self.weight = nn.Parameter(torch.zeros(self.local, hidden, dtype=dtype), requires_grad=False)

    def weight_loader(self, source) -> None:
        check_shape(f"{self.name}.weight", source, (self.vocab, self.hidden))
        if self.valid:
            copy_into(self.weight[: self.valid], narrow(source, 0, self.start, self.valid), f"{self.name}.weight")


class VocabParallelEmbedding(_VocabShard):
    """Rows for ids in this rank's range, zeros elsewhere, summed over tp."""

    def __init__(
        self, vocab: int, hidden: int, tp: Communicator, dtype: torch.dtype = torch.float32, name: str = "embed_tokens"
    ):
        super().__init__(vocab, hidden, tp, dtype, name)
        self.dtype = dtype
        self._scheme: Optional[str] = None  # set by set_quantization: the next load keeps integers
        self._tied: tuple = ()  # (the LM head sharing this table,): a tuple, so not a second parent of it

    @property
    def quantized(self) -> Optional[nn.Module]:
        """The packed table (GroupQuantLinear or Int8Linear) once loaded quantized, else None."""
        return self._modules.get("qlinear")

    def set_quantization(self, scheme: str, head: Optional["ParallelLMHead"] = None) -> None:
        """Hold the table as `scheme` has it (before loading; the float weight is dropped, never
        filled). `head`: the LM head tied to this table, given the same integers at load."""
        if check_scheme(scheme) == "none":
            return
        self._scheme, self.weight = scheme, None
        if head is not None:
            head.weight, self._tied = None, (head,)

    def weight_loader(self, source) -> None:
        if self._scheme is None:
            return super().weight_loader(source)
        check_shape(f"{self.name}.weight", source, (self.vocab, self.hidden))
        if not self.valid:  # a shard of padding only: zeros, as unquantized
            table = head = FloatLinear(torch.zeros(self.local, self.hidden, dtype=self.dtype))
        else:
            label = f"{self.name}.weight"
            block = read_block(source, slice(self.start, self.start + self.valid), slice(None), self._scheme, label)
            if self._tied:
                table, head = pack_tied(block, self.dtype, label, self.local, native=self._tied[0].kernels is not None)
            else:
                table, head = pack_lookup(block, self.dtype, label, self.local), None
        if isinstance(table, FloatLinear):
            self.weight = nn.Parameter(table.weight, requires_grad=False)
        else:
            self.add_module("qlinear", table)
        if self._tied and head is table and isinstance(table, FloatLinear):
            self._tied[0].weight = self.weight  # the same Parameter, as an unquantized tie
        elif self._tied:
            self._tied[0].hold(head)  # the same module, or torch's int4 form beside the lookup table

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.quantized
        return F.embedding(ids, self.weight) if table is None else table.lookup(ids).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.valid)
        out = self._rows(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)


class ParallelLMHead(QuantizableWeight, _VocabShard):
    """Logits for this rank's vocabulary range, gathered so every rank holds all of them. May hold
    its shard quantized (`set_quantization`); the padding rows past the vocabulary stay zero."""

    def __init__(
        self, vocab: int, hidden: int, tp: Communicator, dtype: torch.dtype = torch.float32, name: str = "lm_head"
    ):
        super().__init__(vocab, hidden, tp, dtype, name)
        self.kernels = None  # the native CPU kernels, given by use_native_kernels

    def set_quantization(self, scheme: str, rows=None) -> None:
        super().set_quantization(scheme, rows=self.local)

    def weight_loader(self, source) -> None:
        if self._shard is None:
            return super().weight_loader(source)
        check_shape(f"{self.name}.weight", source, (self.vocab, self.hidden))
        if self.valid:
            rows = slice(self.start, self.start + self.valid)
            return self._load_quantized(source, rows, slice(None), 0, f"{self.name}.weight")
        dtype, self._shard = self._shard.dtype, None  # a shard of padding only: zeros, as unquantized
        self.weight = nn.Parameter(torch.zeros(self.local, self.hidden, dtype=dtype), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_from_tp(self._matmul(hidden, None).contiguous(), self.tp)
        return logits[..., : self.vocab] if logits.shape[-1] != self.vocab else logits

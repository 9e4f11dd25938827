"""Vocabulary-parallel embedding and LM head: each tp rank owns a contiguous vocabulary range
(padded when tp does not divide the vocabulary)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist_infer.comm.base import Communicator
from dist_infer.parallel.linear import skinny_linear
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

    def __init__(self, vocab: int, hidden: int, tp: Communicator, dtype: torch.dtype = torch.float32,
                 name: str = "embed_tokens"):
        super().__init__(vocab, hidden, tp, dtype, name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.valid)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)


class ParallelLMHead(_VocabShard):
    """Logits for this rank's vocabulary range, gathered so every rank holds all of them."""

    def __init__(self, vocab: int, hidden: int, tp: Communicator, dtype: torch.dtype = torch.float32,
                 name: str = "lm_head"):
        super().__init__(vocab, hidden, tp, dtype, name)
        self.kernels = None  # the native CPU kernels, given by use_native_kernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_from_tp(skinny_linear(hidden, self.weight, kernels=self.kernels).contiguous(), self.tp)
        return logits[..., : self.vocab] if logits.shape[-1] != self.vocab else logits

"""Sequence parallelism for the tensor-parallel decoder layer (Megatron-LM's SP, for inference).

Plain tp ends every row-parallel projection with an all-reduce, after which every rank holds
the whole [T, H] residual and computes the same residual add and RMSNorm over all T tokens:
tp copies of identical work. SP splits the all-reduce into its two halves around that work:

    partial [T, H] --reduce_scatter--> my T/tp rows --residual, RMSNorm--> --all_gather--> [T, H]

The same bytes cross the wire (a ring all-reduce is a reduce-scatter plus an all-gather), the
residual and the norm run on T/tp rows, and between layers each rank holds only its T/tp rows
of the residual stream. It costs a second synchronisation per projection, so it pays only on
steps with many tokens (prefill), not decode. Rows are padded with zeros to a multiple of tp;
the padding never leaves this module.
"""

from __future__ import annotations

from typing import Optional

import torch

from dist_infer.comm.base import Communicator


def sequence_rows(tokens: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(first row, rows of real tokens, rows per rank) of this rank's slice of `tokens` rows."""
    per = -(-tokens // tp_size)
    start = tp_rank * per
    return start, max(0, min(per, tokens - start)), per


def scatter_to_sequence_parallel(x: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """This rank's rows of a replicated [T, H] tensor, zero-padded to T / tp rounded up."""
    start, count, per = sequence_rows(x.shape[0], tp.size, tp.rank)
    if count == per:
        return x[start : start + per].clone()
    out = x.new_zeros(per, *x.shape[1:])
    out[:count] = x[start : start + count]
    return out


def gather_from_sequence_parallel(x_local: torch.Tensor, tp: Communicator, tokens: int) -> torch.Tensor:
    """Every rank's rows, concatenated in rank order: the replicated [tokens, H] tensor."""
    if tp.size == 1:
        return x_local[:tokens]
    out = torch.empty(
        (tp.size * x_local.shape[0],) + tuple(x_local.shape[1:]), dtype=x_local.dtype, device=x_local.device
    )
    tp.all_gather(out, x_local.contiguous())
    return out[:tokens]


def reduce_scatter_to_sequence_parallel(partial: torch.Tensor, tp: Communicator) -> torch.Tensor:
    """Sum the tp ranks' partial [T, H] results, keeping only this rank's rows."""
    tokens = partial.shape[0]
    _, _, per = sequence_rows(tokens, tp.size, tp.rank)
    if tp.size == 1:
        return partial
    if per * tp.size != tokens:
        padded = partial.new_zeros(per * tp.size, *partial.shape[1:])
        padded[:tokens] = partial
        partial = padded
    out = partial.new_empty(per, *partial.shape[1:])
    tp.reduce_scatter(out, partial.contiguous())
    return out


def should_sequence_parallel(mode: str, tokens: int, tp_size: int, threshold: Optional[int]) -> bool:
    """Whether a step of `tokens` tokens runs sequence parallel: 'on' whenever tp > 1, 'auto' from
    `threshold` up (never where the threshold is None: no device kind where it was measured to pay)."""
    if mode not in ("on", "off", "auto"):
        raise ValueError(f"sequence-parallel mode must be on, off or auto, got {mode!r}")
    if mode == "off" or tp_size == 1:
        return False
    return mode == "on" or (threshold is not None and tokens >= threshold)

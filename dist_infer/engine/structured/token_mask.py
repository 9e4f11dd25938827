"""The token bitmask: which tokens a grammar allows next, one bit per token, as plain torch.

A mask row holds W = ceil(V/32) int32 words; bit j of word w allows token 32*w + j (llguidance
writes that layout). Applying it sets every disallowed logit to -inf: the columns past 32*W, which
no grammar can allow, included. llguidance.torch's own apply compiles a kernel with
torch.compile (seconds on first use on a CPU, and a C++ compiler), so this is ours.
"""

from __future__ import annotations

import sys
from typing import Iterable, Sequence

import torch


def mask_words(vocab_size: int) -> int:
    """int32 words in a mask row over `vocab_size` tokens."""
    return -(-vocab_size // 32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab_size/32)] int32 on the host, every token allowed (-1: every bit set)."""
    return torch.full((rows, mask_words(vocab_size)), -1, dtype=torch.int32)


def byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit k of the byte value v (a table of 2 KiB, made per call: cheaper than a cache)."""
    values = torch.arange(256, dtype=torch.int32, device=device)
    return ((values[:, None] >> torch.arange(8, dtype=torch.int32, device=device)) & 1).bool()


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool: True where the mask allows the token (False past 32*W).
    On a little-endian host a word's bytes are its bits in token order, 8 at a time: one lookup
    per byte (a quarter of the work of 32 shifts per word)."""
    if sys.byteorder == "little":
        as_bytes = bitmask.contiguous().view(torch.uint8).long()  # [R, 4W]
        allowed = byte_bits(bitmask.device)[as_bytes].reshape(bitmask.shape[0], -1)
    else:
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: bit 31 of a negative word is 1 too
        allowed = bits.reshape(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Set to -inf, in place, each logit of row rows[i] of `logits` [B, V] that bitmask[i] [M, W]
    disallows; the other rows are left alone. Returns `logits`."""
    if not len(rows):
        return logits
    disallowed = allowed_tokens(bitmask.to(logits.device, non_blocking=True), logits.shape[1]).logical_not_()
    if list(rows) == list(range(logits.shape[0])):  # every row, in order: no gather and scatter
        return logits.masked_fill_(disallowed, float("-inf"))
    index = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits


def allows_only(bitmask_row: torch.Tensor, token_ids: Iterable[int]) -> bool:
    """Whether the mask row [W] allows no token outside `token_ids` (a grammar that can only end)."""
    rest = bitmask_row.clone()
    for t in token_ids:
        if 0 <= t < 32 * rest.numel():
            rest[t // 32] &= ~(1 << (t % 32)) if t % 32 < 31 else 0x7FFFFFFF
    return not bool(rest.any())

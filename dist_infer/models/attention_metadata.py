"""The per-step attention metadata, and how it is built.

Tokens of all sequences in a step travel flattened ([tokens, ...], vLLM's varlen layout); a
sequence's keys live in the KV-cache blocks its block table lists. `AttentionMetadata` is
computed once per step by the engine and shared by every layer: where the new keys go
(slot_mapping), how to pad queries into a batch, and the mask. The context-parallel addition
(`ContextParallelMetadata`) and the two-halves split (`TokenSplit`) live here too, so that the
attention paths (attention.py, cp_attention.py) and the engine all read one module and none
of them imports another's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from dist_infer.parallel.ring.blocks import Block
from dist_infer.parallel.ring.layout import RingLayout


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of every new token
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of every new token
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context per sequence after this step, new tokens included
    block_tables: torch.Tensor  # [B, max_blocks] block ids (padding: 0, never read unmasked)
    pad_index: torch.Tensor  # [T] row of each token in the padded [B * max_q] query batch
    mask: Optional[torch.Tensor]  # [B, 1, max_q, max_ctx] True = may attend; None: plain causal
    last_token_index: torch.Tensor  # [B] index in [T] of each sequence's last new token
    max_q: int
    max_ctx: int
    fresh: bool  # no sequence has cached context: attend to the new keys directly
    cp: Optional[ContextParallelMetadata] = None  # set when the sequence is sharded over cp ranks (cp_attention.py)
    seq_lens_t: Optional[torch.Tensor] = None  # seq_lens as a tensor, for the native decode kernel
    window: Optional[int] = None  # sliding window: a query sees the last `window` positions
    sequence_parallel: bool = False  # the step's tp layers run sequence parallel (parallel/sequence_parallel.py)
    # A mixed step (decodes beside prompt chunks, or prompts of different lengths) attends in parts:
    # (rows of the step's tokens, their own metadata). Padding every sequence to the longest
    # query would cost batch x longest chunk query rows: 60 decodes beside a 256-token chunk
    # would attend 15360 rows instead of 316.
    parts: Optional[list[tuple[torch.Tensor, "AttentionMetadata"]]] = None
    # speculative decoding: the rows of [T] whose logits the last stage returns, a sequence's last
    # few where it verifies proposals (engine/speculative); None: each sequence's last token only
    logit_rows: Optional[torch.Tensor] = None
    # the rows of [T] that are prompt tokens (bool [T]; None: none), which bf16 prompts
    # (`--prompt-dtype`, models/fused_decode.py) run in bf16: a property of the token, not of the step
    prompt_rows: Optional[torch.Tensor] = None

    @property
    def decode(self) -> bool:
        """One new token per sequence: the step the native decode attention serves."""
        return self.max_q == 1

    @property
    def batch(self) -> int:
        return len(self.query_lens)

    @property
    def uniform(self) -> bool:
        return self.mask is None

    @property
    def packed(self) -> bool:
        """Every sequence has the same number of new tokens (every decode step): the flat tokens
        are already the [B, max_q] batch, no padding or gathering needed."""
        return self.pad_index.numel() == self.batch * self.max_q

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "AttentionMetadata":
        """A copy with every tensor (its parts' and cp's too) passed through `move`: the metadata is
        built on the host from the plan's lists, and the engine moves it to the model's device once."""
        fields = {
            f.name: move(v) for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)
        }
        parts = None if self.parts is None else [(move(rows), sub.moved(move)) for rows, sub in self.parts]
        cp = None if self.cp is None else self.cp.moved(move)
        return dataclasses.replace(self, **fields, parts=parts, cp=cp)


@dataclass
class ContextParallelMetadata:
    """What the cp path adds to a step's AttentionMetadata (built in cp_attention.py)."""

    phase: str  # "prefill" (ring over the new tokens) | "decode" (attend the local shard, merge)
    variant: str  # prefill: "pass-kv" | "pass-q"
    layout: Optional[RingLayout]  # prefill: every cp rank's rows
    steps: Optional[list[list[Block]]]  # prefill: this rank's blocks per ring step, shared by all layers
    store_rows: Optional[torch.Tensor]  # rows whose K/V this rank stores (None: all); slots in slot_mapping
    last_rows: torch.Tensor  # prefill: [B] this rank's row of each sequence's last token, -1 if another rank has it

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "ContextParallelMetadata":
        return dataclasses.replace(
            self,
            **{
                f.name: move(v)
                for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), torch.Tensor)
            },
        )


@dataclass
class TokenSplit:
    """A step's tokens cut in two halves that run interleaved (see parallel/token_split.py)."""

    a: AttentionMetadata
    b: AttentionMetadata
    cut: int  # tokens [0, cut) are half a
    full: AttentionMetadata  # the whole step, for layers that run unsplit (the trimmed last layer)

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> "TokenSplit":
        return TokenSplit(self.a.moved(move), self.b.moved(move), self.cut, self.full.moved(move))


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    sliding_window: Optional[int] = None,
    logit_counts: Optional[Sequence[int]] = None,
    prompt_counts: Optional[Sequence[int]] = None,
) -> AttentionMetadata:
    """Everything a step's attention needs, from the sequences' lengths and block tables.
    `logit_counts`: how many of each sequence's last rows the last stage returns logits for
    (speculative verification); None or all ones: each sequence's last row. `prompt_counts`: how
    many of each sequence's first new tokens are its prompt's (None: none)."""
    B = len(query_lens)
    max_q, max_ctx = max(query_lens), max(seq_lens)
    positions, slots, pad_index, last = [], [], [], []
    flat = 0
    for b, (q, s, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
        start = s - q
        for p in range(start, s):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        pad_index.extend(range(b * max_q, b * max_q + q))
        flat += q
        last.append(flat - 1)
    width = max(len(t) for t in block_tables)
    tables = torch.zeros(B, width, dtype=torch.long)
    for b, t in enumerate(block_tables):
        tables[b, : len(t)] = torch.tensor(t, dtype=torch.long)
    fresh = all(q == s for q, s in zip(query_lens, seq_lens))
    uniform = fresh and len(set(query_lens)) == 1 and (sliding_window is None or max_q <= sliding_window)
    mask = None
    if not uniform:
        q_pos = torch.tensor([s - q for q, s in zip(query_lens, seq_lens)])[:, None] + torch.arange(max_q)[None, :]
        k_pos = torch.arange(max_ctx)[None, None, :]
        mask = k_pos <= q_pos[:, :, None]
        if sliding_window is not None:
            mask &= k_pos > q_pos[:, :, None] - sliding_window
        padded_rows = torch.arange(max_q)[None, :] >= torch.tensor(query_lens)[:, None]
        mask[padded_rows] = False
        mask[..., 0] |= padded_rows  # padded query rows look at one key: no NaN, result discarded
        mask = mask.unsqueeze(1)
    parts = None
    if B > 1 and len(set(query_lens)) > 1:
        parts = _parts(query_lens, seq_lens, block_tables, block_size, sliding_window)
    return AttentionMetadata(
        parts=parts,
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_lens=list(query_lens),
        seq_lens=list(seq_lens),
        block_tables=tables,
        pad_index=torch.tensor(pad_index, dtype=torch.long),
        mask=mask,
        last_token_index=torch.tensor(last, dtype=torch.long),
        max_q=max_q,
        max_ctx=max_ctx,
        fresh=fresh,
        seq_lens_t=torch.tensor(list(seq_lens), dtype=torch.long),
        window=sliding_window,
        logit_rows=logit_rows(query_lens, logit_counts),
        prompt_rows=prompt_rows(query_lens, prompt_counts),
    )


def prompt_rows(query_lens: Sequence[int], counts: Optional[Sequence[int]]) -> Optional[torch.Tensor]:
    """bool [T]: the first `counts[b]` new tokens of sequence b (its prompt's, at most its new
    tokens); None where no sequence has any."""
    if not counts or not any(counts):
        return None
    rows = torch.zeros(sum(query_lens), dtype=torch.bool)
    at = 0
    for q, c in zip(query_lens, counts):
        rows[at : at + min(max(0, c), q)] = True
        at += q
    return rows


def logit_rows(query_lens: Sequence[int], counts: Optional[Sequence[int]]) -> Optional[torch.Tensor]:
    """The rows of a step's flat tokens whose logits are wanted: the last `counts[b]` of sequence b
    (at most its new tokens); None where every count is one (the last token's, the usual step)."""
    if counts is None or all(c <= 1 for c in counts):
        return None
    rows, end = [], 0
    for q, c in zip(query_lens, counts):
        end += q
        rows += range(end - min(max(1, c), q), end)
    return torch.tensor(rows, dtype=torch.long)


def _parts(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    sliding_window: Optional[int],
) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """The decodes together (one packed batch), each longer query on its own."""
    starts = [sum(query_lens[:b]) for b in range(len(query_lens))]
    decodes = [b for b, q in enumerate(query_lens) if q == 1]
    groups = ([decodes] if decodes else []) + [[b] for b, q in enumerate(query_lens) if q > 1]
    out = []
    for g in groups:
        rows = torch.tensor([r for b in g for r in range(starts[b], starts[b] + query_lens[b])], dtype=torch.long)
        sub = build_attention_metadata(
            [query_lens[b] for b in g],
            [seq_lens[b] for b in g],
            [block_tables[b] for b in g],
            block_size,
            sliding_window,
        )
        out.append((rows, sub))
    return out


def split_token_halves(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    sliding_window: Optional[int] = None,
    split_at: Optional[int] = None,
    logit_counts: Optional[Sequence[int]] = None,
) -> TokenSplit:
    """Metadata for the two token halves of a step (TokenWeave's split).

    The flattened tokens are cut at `split_at` (default: the middle). A sequence that straddles
    the cut appears in both halves: the first half writes its keys to the cache, and the second
    half, which runs later in every layer, reads them from there like cached context.
    """
    total = sum(query_lens)
    if total < 2:
        raise ValueError(f"cannot split {total} token(s) into two halves")
    cut = total // 2 if split_at is None else split_at
    halves: list[tuple[list[int], list[int], list[list[int]]]] = [([], [], []), ([], [], [])]
    start = 0
    for q, s, table in zip(query_lens, seq_lens, block_tables):
        end = start + q
        first = max(0, min(end, cut) - start)  # this sequence's tokens before the cut
        if first:
            halves[0][0].append(first)
            halves[0][1].append(s - q + first)
            halves[0][2].append(list(table))
        if q - first:
            halves[1][0].append(q - first)
            halves[1][1].append(s)
            halves[1][2].append(list(table))
        start = end
    a, b = (build_attention_metadata(ql, sl, bt, block_size, sliding_window) for ql, sl, bt in halves)
    full = build_attention_metadata(query_lens, seq_lens, block_tables, block_size, sliding_window, logit_counts)
    return TokenSplit(a, b, cut, full)

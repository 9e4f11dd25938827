"""The step plan: what the driver tells every other rank about one forward step.

Which sequences, how many new tokens each, where their context starts, their block tables,
the token ids (for the first pipeline stage), which rows to sample and how, and which
sequences were freed since the last plan (context-parallel ranks keep their own shard
bookkeeping), and the KV block transfers of live migrations (engine/kv_transfer.py), which every
rank runs before the step's forward. Rows of requests with structured outputs carry their grammar's
token bitmask (engine/structured), which the sampler rank applies; a step without any carries
none. A speculating sequence (engine/speculative) carries its last token and K proposed ones, and
asks for the logits of all K + 1 positions: its `sample` entry is K + 1, and the sampler draws a
token at each position with the row's parameters at that position's token index (the driver then
keeps what matches the proposals). Nothing else is coordinated. Encoded as one int64 and one float64 tensor so it
travels as two messages; `encode`/`decode` are pure and tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from dist_infer.engine.kv_transfer import TransferOp
from dist_infer.engine.sampling import RowSampling

KIND_STOP, KIND_IDLE, KIND_WORK = 0, 1, 2
_HEAD = 13  # kind, step, seqs, tokens, table entries, sampled rows, freed, return_logits, top logprobs, transfer ints,
# layered sequences, masked rows, words per mask row
_PER_SEQ = 6  # seq id, new tokens, context before, table length, positions sampled, prompt tokens
_PER_ROW = 7  # temperature, top_k, top_p, seed, index, logprobs, ban_eos


@dataclass
class StepPlan:
    kind: int = KIND_WORK
    step: int = 0
    seq_ids: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens per sequence
    starts: list[int] = field(default_factory=list)  # tokens already cached per sequence
    block_tables: list[list[int]] = field(default_factory=list)
    # positions of each sequence whose next token is drawn: 0 (a prompt chunk short of its end), 1 (its
    # last position), K + 1 (a speculating sequence: its last token and K proposals); a bool works as 0/1
    sample: list[int] = field(default_factory=list)
    rows: list[RowSampling] = field(default_factory=list)  # one per sampled sequence, in order
    input_ids: list[int] = field(default_factory=list)  # the new tokens, flattened
    # how many of each sequence's new tokens are its prompt's (the first ones; empty: none), the rows
    # bf16 prompts run in bf16 (models/fused_decode.py): the same rows however the prompt is chunked
    prompt_tokens: list[int] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)  # seq ids whose cache the ranks may forget
    return_logits: bool = False
    transfers: list[TransferOp] = field(default_factory=list)  # run before the forward, in order
    # layered prefill (engine/layered_prefill.py): (index of the sequence in this plan, first layer, end
    # layer) of each sequence that runs only layers [first, end); the others run every layer
    layered: list[tuple[int, int, int]] = field(default_factory=list)
    # structured outputs: the rows (indices into `rows`) whose grammar limits the tokens, and their
    # bitmasks [len(mask_rows), words] int32 (engine/structured/token_mask.py); None when no row has one
    mask_rows: list[int] = field(default_factory=list)
    masks: Optional[torch.Tensor] = None
    # the driver's own, never sent: masks still being computed while the forward runs (the driver
    # samples: engine/structured/mask_filler.py); the sampler moves them into mask_rows and masks
    pending_masks: Optional[Any] = field(default=None, compare=False, repr=False)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def seq_lens(self) -> list[int]:
        return [s + n for s, n in zip(self.starts, self.num_tokens)]

    @property
    def speculative(self) -> bool:
        """Some sequence asks for the logits of more than its last position."""
        return any(s > 1 for s in self.sample)

    @property
    def logit_counts(self) -> list[int]:
        """Rows of the last stage's output per sequence: each sequence's last position, and all the
        sampled positions of a speculating one."""
        return [max(1, int(s)) for s in self.sample]

    @property
    def sample_index(self) -> list[int]:
        """The rows of the last stage's output that are sampled, in order (one per sampled position)."""
        index, at = [], 0
        for s, rows in zip(self.sample, self.logit_counts):
            index += range(at + rows - int(s), at + rows)
            at += rows
        return index

    @property
    def num_sampled(self) -> int:
        """Positions sampled in all: the rows the sampler returns."""
        return sum(int(s) for s in self.sample)

    def row_offsets(self) -> list[int]:
        """Where each of `rows` (one per sampled sequence) starts among the sampled positions."""
        offsets, at = [], 0
        for s in self.sample:
            if s:
                offsets.append(at)
                at += int(s)
        return offsets

    def position_rows(self) -> list[RowSampling]:
        """One RowSampling per sampled position: a speculating sequence's row at its token index
        + j for position j, EOS banned while that index is below the request's min_tokens
        (`ban_eos` counts the banned positions from the first)."""
        if not self.speculative:
            return self.rows
        out = []
        for row, count in zip(self.rows, (int(s) for s in self.sample if s)):
            out += [replace(row, index=row.index + j, ban_eos=max(0, row.ban_eos - j)) for j in range(count)]
        return out

    @property
    def top_logprobs(self) -> int:
        return max((r.logprobs for r in self.rows), default=0)


def encode(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(plan.seq_ids)
    head = [
        plan.kind,
        plan.step,
        n,
        plan.total_tokens,
        sum(len(t) for t in plan.block_tables),
        len(plan.rows),
        len(plan.freed),
        int(plan.return_logits),
        plan.top_logprobs,
    ]
    transfers = [x for op in plan.transfers for x in op.encode()]
    words = plan.masks.shape[1] if plan.mask_rows else 0
    head += [len(transfers), len(plan.layered), len(plan.mask_rows), words]
    per_seq = []
    for i in range(n):
        prompt = plan.prompt_tokens[i] if plan.prompt_tokens else 0
        per_seq += [plan.seq_ids[i], plan.num_tokens[i], plan.starts[i], len(plan.block_tables[i]), int(plan.sample[i])]
        per_seq.append(prompt)
    tables = [b for t in plan.block_tables for b in t]
    layered = [x for entry in plan.layered for x in entry]
    ints = torch.tensor(
        head + per_seq + tables + list(plan.input_ids) + list(plan.freed) + transfers + layered + list(plan.mask_rows),
        dtype=torch.long,
    )
    if plan.mask_rows:
        ints = torch.cat([ints, pack_masks(plan.masks)])
    floats = torch.tensor(
        [[r.temperature, r.top_k, r.top_p, r.seed, r.index, r.logprobs, r.ban_eos] for r in plan.rows],
        dtype=torch.float64,
    ).reshape(-1)  # seeds < 2**53 are exact in float64
    return ints, floats


def pack_masks(masks: torch.Tensor) -> torch.Tensor:
    """[M, W] int32 -> the same bytes as int64 (rows padded to an even W), for the plan's int64 tensor."""
    m, w = masks.shape
    padded = torch.zeros(m, w + w % 2, dtype=torch.int32)
    padded[:, :w] = masks
    return padded.view(torch.int64).reshape(-1)


def unpack_masks(packed: torch.Tensor, rows: int, words: int) -> torch.Tensor:
    """pack_masks' inverse: [rows, words] int32 from the int64 tail of a plan."""
    return packed.contiguous().view(torch.int32).view(rows, words + words % 2)[:, :words].contiguous()


def decode(ints: torch.Tensor, floats: torch.Tensor) -> StepPlan:
    head = ints[:_HEAD].tolist()
    kind, step, n, tokens, table_entries, rows, freed, logits, _, transfer_ints, layered, masked, words = head
    mask_ints = masked * ((words + 1) // 2)
    v = ints[: ints.numel() - mask_ints].tolist()  # the masks stay a tensor: no Python int per word
    at = _HEAD
    per_seq = [v[at + i * _PER_SEQ : at + (i + 1) * _PER_SEQ] for i in range(n)]
    at += n * _PER_SEQ
    tables = []
    for row in per_seq:
        tables.append(v[at : at + row[3]])
        at += row[3]
    input_ids = v[at : at + tokens]
    at += tokens
    freed_ids = v[at : at + freed]
    at += freed
    transfers, end = [], at + transfer_ints
    while at < end:
        op, at = TransferOp.decode(v, at)
        transfers.append(op)
    layered_entries = [tuple(v[at + 3 * i : at + 3 * i + 3]) for i in range(layered)]
    at += 3 * layered
    mask_rows = v[at : at + masked]
    masks = unpack_masks(ints[ints.numel() - mask_ints :], masked, words) if masked else None
    f = floats.view(-1, _PER_ROW).tolist() if rows else []
    return StepPlan(
        kind=kind,
        step=step,
        seq_ids=[r[0] for r in per_seq],
        num_tokens=[r[1] for r in per_seq],
        starts=[r[2] for r in per_seq],
        block_tables=tables,
        sample=[r[4] for r in per_seq],
        prompt_tokens=[r[5] for r in per_seq] if any(r[5] for r in per_seq) else [],
        rows=[RowSampling(t, int(k), p, int(s), int(i), int(lp), int(b)) for t, k, p, s, i, lp, b in f],
        input_ids=input_ids,
        freed=freed_ids,
        return_logits=bool(logits),
        transfers=transfers,
        layered=layered_entries,
        mask_rows=mask_rows,
        masks=masks,
    )


def sizes(ints: torch.Tensor, floats: torch.Tensor) -> torch.Tensor:
    """The two payload lengths, sent first so the receivers can size their buffers."""
    return torch.tensor([ints.numel(), floats.numel()], dtype=torch.long)

"""Where a step's tensors cross between the host and the model's device: the only two places.

The engine builds a step's inputs (token ids, attention metadata, block indices) on the host from
the plan's lists and moves them to the model's device once, with `to_device`; the results the
host needs (sampled ids and logprobs for the API, logits when asked for) come back once, with
`to_host`. Everything between stays on the device. On a CPU model both are no-ops, so a CPU run
is exactly what it was.

On CUDA the host side goes through pinned (page-locked) memory, and only there: a host -> device
copy from pinned memory does not block the host (torch's caching host allocator keeps the staging
buffer until the copy has run), and a device -> host copy into pinned memory is the fastest way
for the host to wait for values it needs at once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from dist_infer.engine.sampling import SampledTokens


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a model stage lives: its first parameter's device (the CPU for a stage without any)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`: `t` itself where it is already there; to CUDA through pinned memory."""
    if t.device == device or (device.type == "cpu" and t.device.type == "cpu"):
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def host_index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index built from host values, on `device` (a CPU index into a device tensor is a
    hidden copy and synchronisation)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


def to_host(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`t`'s values on the host: `t` itself on the CPU; from CUDA into a pinned buffer (this waits)."""
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    host.copy_(t)
    return host


def sampled_to_host(sampled: SampledTokens) -> SampledTokens:
    """A step's sampled rows where the driver reads them (the sampler leaves them on the logits' device)."""
    if sampled.tokens.device.type == "cpu":
        return sampled
    return replace(
        sampled,
        tokens=to_host(sampled.tokens),
        logprobs=to_host(sampled.logprobs),
        top_ids=to_host(sampled.top_ids),
        top_logprobs=to_host(sampled.top_logprobs),
        logits=to_host(sampled.logits),
    )


class DecodeInputs:
    """The persistent inputs of a decode step of `rows` sequences (padded up to them): token ids,
    positions, cache slots, context lengths and block tables [rows, width], in one int64 buffer on
    the device, filled with one host-to-device copy per step from a pinned staging buffer. A
    captured CUDA graph reads them at fixed addresses; eagerly they are a step's metadata as is.

    Padding rows (past the step's own) decode token 0 at position 0 into `scratch_slot`, a cache
    slot no sequence owns, and attend to that one key: their results are never read."""

    FIELDS = 4  # ids, positions, slots, lengths; then the tables

    def __init__(self, rows: int, width: int, scratch_slot: int, block_size: int, device: torch.device):
        self.rows, self.width, self.block_size = rows, width, block_size
        self.scratch_slot = scratch_slot
        n = rows * (self.FIELDS + width)
        self.device_buffer = torch.zeros(n, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        # two staging buffers: the next step fills one while the last one's copy may still be queued
        self._staging = [torch.zeros(n, dtype=torch.long, pin_memory=pinned) for _ in range(2 if pinned else 1)]
        self._copied = [torch.cuda.Event() if pinned else None for _ in self._staging]
        self._turn = 0
        self.ids, self.positions, self.slots, self.seq_lens = (
            self.device_buffer[i * rows : (i + 1) * rows] for i in range(self.FIELDS)
        )
        self.block_tables = self.device_buffer[self.FIELDS * rows :].view(rows, width)
        self._pad_all()

    def _pad_all(self) -> None:
        host = self._staging[0].numpy()
        self._write_padding(host, 0)
        self.device_buffer.copy_(self._staging[0])

    def _write_padding(self, host, start: int) -> None:
        """Rows [start, rows) of a staging buffer (a numpy view) as padding rows."""
        rows, slot = self.rows, self.scratch_slot
        host[start:rows] = 0  # ids
        host[rows + start : 2 * rows] = 0  # positions
        host[2 * rows + start : 3 * rows] = slot
        host[3 * rows + start : 4 * rows] = 1  # each padding row sees its one key
        tables = host[self.FIELDS * rows :].reshape(rows, self.width)
        tables[start:] = slot // self.block_size

    def fill(self, input_ids: list[int], starts: list[int], block_tables: list[list[int]]) -> None:
        """The step's rows (one new token each, after `starts` cached ones) then padding rows: one copy."""
        b, rows, bs = len(input_ids), self.rows, self.block_size
        if b > rows:
            raise ValueError(f"a decode step of {b} sequences does not fit the {rows} rows of its inputs")
        turn = self._turn
        self._turn = (turn + 1) % len(self._staging)
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # that buffer's copy (two steps ago) has run
        staging = self._staging[turn]
        host = staging.numpy()
        pos = np.asarray(starts, dtype=np.int64)
        tables = host[self.FIELDS * rows :].reshape(rows, self.width)
        for i, table in enumerate(block_tables):
            if len(table) > self.width:
                raise ValueError(
                    f"a block table of {len(table)} blocks is wider than the {self.width} of the decode inputs"
                )
            tables[i, : len(table)] = table
        host[:b] = input_ids
        host[rows : rows + b] = pos
        host[2 * rows : 2 * rows + b] = tables[np.arange(b), pos // bs] * bs + pos % bs
        host[3 * rows : 3 * rows + b] = pos + 1
        self._write_padding(host, b)
        self.device_buffer.copy_(staging, non_blocking=True)
        if self._copied[turn] is not None:
            self._copied[turn].record()

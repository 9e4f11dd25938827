"""The decode step as a captured CUDA graph per batch-size bucket, replayed every decode step.

On a GPU a decode step of a small model is bound by launching its kernels from Python, not by
the kernels (docs/benchmarks.md, "The CUDA paths"). vLLM and SGLang capture the step once per
batch size and replay it; so does this module. A step of B sequences runs in the smallest bucket
>= B (1, 2, 4, 8, ... up to the largest batch the engine schedules); its inputs live in the
bucket's persistent buffers (engine/device_io.py `DecodeInputs`), filled with one host-to-device
copy, and the rows past B are padding that writes to a scratch cache slot and is never read.
Inside the step nothing reads a value back to the host: the attention reads each sequence's
length on the device (kernels/gpu/paged_decode.py), so the graph holds for any lengths.

Modes (`--cuda-graphs`): 'auto' captures on a CUDA stage of a tp=1, pp=1 instance and falls back
to eager steps, with a warning naming the cause, where capture fails; 'on' captures or raises; 'off' runs every step
eagerly as before. 'padded' (library only) runs the bucketed, padded steps eagerly without a
graph: how the CPU tests hold this module's buffers and padding to the plain step's ids.
Prompt and mixed steps stay eager; so do token-split and sequence-parallel steps (their
metadata is not a plain decode step's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from loguru import logger

from dist_infer.engine.device_io import DecodeInputs
from dist_infer.models.attention_metadata import AttentionMetadata

GRAPH_MODES = ("auto", "on", "off", "padded")


class GraphCaptureError(RuntimeError):
    """A decode step could not be captured (with --cuda-graphs on)."""


def graph_buckets(max_rows: int) -> list[int]:
    """Batch sizes captured: powers of two from 1 up to the first >= max_rows."""
    buckets, b = [], 1
    while True:
        buckets.append(b)
        if b >= max_rows:
            return buckets
        b *= 2


def check_graph_mode(mode: str) -> None:
    if mode not in GRAPH_MODES:
        raise ValueError(f"--cuda-graphs {mode!r}: one of {', '.join(GRAPH_MODES[:3])}")


def graphs_wanted(mode: str, device: torch.device) -> bool:
    """Whether `mode` asks for bucketed decode steps on `device`; 'on' without CUDA is an error."""
    check_graph_mode(mode)
    if mode == "on" and device.type != "cuda":
        raise GraphCaptureError(f"--cuda-graphs on needs a CUDA stage; this one is on {device.type}")
    # auto: a real device (the placement tests' fake CUDA stages run eagerly)
    return mode == "padded" or mode == "on" or (mode == "auto" and device.type == "cuda" and torch.cuda.is_available())


@dataclass
class StaticDecodeStep:
    """A decode step planned into a bucket's buffers: what `DecodeGraphs.run` replays."""

    bucket: int
    rows: int  # the step's own rows; the rest of the bucket is padding


@dataclass
class _Bucket:
    inputs: DecodeInputs
    meta: AttentionMetadata
    graph: Optional["torch.cuda.CUDAGraph"] = None
    output: Optional[torch.Tensor] = None  # the graph's output buffer


def static_metadata(inputs: DecodeInputs, window: Optional[int]) -> AttentionMetadata:
    """A decode step's metadata over a bucket's buffers (views: the values change per step, not the tensors)."""
    rows, device = inputs.rows, inputs.device_buffer.device
    every = torch.arange(rows, device=device)
    max_ctx = inputs.width * inputs.block_size
    return AttentionMetadata(
        positions=inputs.positions,
        slot_mapping=inputs.slots,
        query_lens=[1] * rows,
        seq_lens=[max_ctx] * rows,
        block_tables=inputs.block_tables,
        pad_index=every,
        mask=None,
        last_token_index=every,
        max_q=1,
        max_ctx=max_ctx,
        fresh=False,
        seq_lens_t=inputs.seq_lens,
        window=window,
    )


class DecodeGraphs:
    """One stage's bucketed decode steps: their buffers, and on CUDA their captured graphs.

    `forward(inputs, meta)` runs the stage (token ids on the first stage, hidden states of width
    `input_width` after it); `capture` says whether to capture (CUDA) or replay eagerly (padded)."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor],
        first_stage: bool,
        input_width: int,
        dtype: torch.dtype,
        max_rows: int,
        table_width: int,
        block_size: int,
        scratch_slot: int,
        window: Optional[int],
        device: torch.device,
        capture: bool,
    ):
        self.forward, self.first_stage, self.capture_graphs = forward, first_stage, capture
        self.device = device
        self.buckets: dict[int, _Bucket] = {}
        for b in graph_buckets(max_rows):
            inputs = DecodeInputs(b, table_width, scratch_slot, block_size, device)
            self.buckets[b] = _Bucket(inputs, static_metadata(inputs, window))
        top = max(self.buckets)
        self.hidden = None if first_stage else torch.zeros(top, input_width, dtype=dtype, device=device)
        self.capture_s, self.graph_bytes = 0.0, 0

    def bucket_for(self, rows: int) -> Optional[int]:
        """The smallest bucket that holds `rows` sequences (None: more than the largest)."""
        return next((b for b in sorted(self.buckets) if b >= rows), None)

    def prepare(
        self, input_ids: list[int], starts: list[int], block_tables: list[list[int]]
    ) -> Optional[StaticDecodeStep]:
        """Fill the step's bucket (one host-to-device copy); None where no bucket holds it."""
        bucket = self.bucket_for(len(starts))
        if bucket is None:
            return None
        self.buckets[bucket].inputs.fill(input_ids if self.first_stage else [0] * len(starts), starts, block_tables)
        return StaticDecodeStep(bucket, len(starts))

    def _inputs(self, bucket: int) -> torch.Tensor:
        return self.buckets[bucket].inputs.ids if self.first_stage else self.hidden[:bucket]

    def run(self, step: StaticDecodeStep, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The step's output rows ([rows, ...] of the bucket's output): a replay, or an eager run."""
        b = self.buckets[step.bucket]
        if hidden is not None:
            self.hidden[: step.rows].copy_(hidden)
        if b.graph is not None:
            b.graph.replay()
            return b.output[: step.rows]
        with torch.inference_mode():
            return self.forward(self._inputs(step.bucket), b.meta)[: step.rows]

    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (CUDA); reports time and memory."""
        if not self.capture_graphs:
            return
        start = time.perf_counter()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            b = self.buckets[bucket]
            inputs = self._inputs(bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():  # first run: kernels compiled, workspaces made
                self.forward(inputs, b.meta)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                b.output = self.forward(inputs, b.meta)
            b.graph = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        self.graph_bytes = torch.cuda.memory_reserved() - before
        logger.info(
            f"CUDA graphs: {len(self.buckets)} decode buckets (1..{max(self.buckets)} sequences) captured "
            f"in {self.capture_s:.2f} s, {self.graph_bytes / 2**20:.0f} MiB"
        )

    def drop(self) -> None:
        """Give the graphs back (their memory pool with them)."""
        for b in self.buckets.values():
            b.graph = b.output = None

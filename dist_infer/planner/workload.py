"""What a prediction is asked about: the workload (batch, lengths, dtypes), the engine's schedule
choices, and the model, layout and hardware they run on, bundled as one `Setup`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dist_infer.planner.hardware import HardwareProfile
from dist_infer.planner.layout import Layout
from dist_infer.planner.shapes import ModelShape

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0}
GIB = float(1 << 30)


@dataclass(frozen=True)
class Workload:
    batch: int
    prompt_len: int
    gen_len: int
    weight_dtype: str = "fp32"  # the GEMMs' dtype (its rate and the weights' bytes)
    mlp_dtype: str = ""  # the MLP's GEMMs when they differ (e.g. FP8 feed-forward, BF16 attention); "": weight_dtype
    act_dtype: str = "fp32"  # activations and what the collectives move
    attention_dtype: str = "fp32"
    kv_dtype: str = "fp32"


@dataclass(frozen=True)
class Schedule:
    """The engine's choices the time depends on."""

    overlap: str = "auto"  # token splitting: on / off / auto (from overlap_threshold tokens per step)
    overlap_threshold: Optional[int] = 1024  # None: auto never splits (the engine's CPU default)
    ranks_per_node: int = 8  # GPUs per node, or ranks started on each CPU node
    cores_per_node: Optional[int] = None  # CPU: the node's cores (None: the profile's)


@dataclass(frozen=True)
class Setup:
    """One prediction's inputs, passed whole to the functions that count its terms."""

    shape: ModelShape
    layout: Layout
    work: Workload
    hw: HardwareProfile
    sched: Schedule = Schedule()


def micro_batches(batch: int, pp: int) -> int:
    """How many steps the scheduler cuts a batch into with pp stages (ceil(B / pp) sequences each)."""
    if pp <= 1:
        return 1
    per = math.ceil(batch / pp)
    return math.ceil(batch / per)

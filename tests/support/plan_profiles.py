"""A model shape small enough to reason about by hand, Llama 3's 405B, and a profile with only the
costs a test asks for: the planner's tests, in process and through the CLI."""

from __future__ import annotations

from dist_infer.planner.hardware import HardwareProfile, Link
from dist_infer.planner.shapes import ModelShape

SMALL = ModelShape(hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16, vocab=100)
BIG = 1e30  # a rate so high its term vanishes
LLAMA3_405B = ModelShape(
    hidden=16384, intermediate=53248, layers=126, heads=128, kv_heads=8, head_dim=128, vocab=128256
)  # the published shape: its size checked, Meta's prefills predicted


def gemm_only_profile(rate: float = 1e9, **over) -> HardwareProfile:
    """Every cost zero but the GEMMs (at `rate` FLOP/s) unless `over` says otherwise."""
    fields = dict(
        name="test",
        device="cuda",
        gemm_flops={"fp32": rate},
        attention_flops={"fp32": BIG},
        memory_bandwidth=BIG,
        memory_bytes=1e12,
        devices_per_node=8,
        links={"intra": Link(0.0, BIG), "inter": Link(0.0, BIG)},
    )
    fields.update(over)
    return HardwareProfile(**fields)

"""Choosing the ring variant: pass-KV (keys/values travel) or pass-Q (queries travel).

The choice depends only on token and head counts and on hardware estimates, not on any
tensor, so it lives apart from the ring loops and is unit tested without processes.
"""

from __future__ import annotations

from typing import Optional

from dist_infer.parallel.ring.errors import RingAttentionError

VARIANTS = ("pass-kv", "pass-q")
# (attention FLOP/s per rank, ring link bytes/s) for `choose_ring_variant` when the caller has no
# better numbers. cpu: measured on a CPU (torch's flash kernel on one thread, gloo point-to-point
# over loopback; docs/benchmarks.md, "Context parallelism: long-prompt prefill, cp=2 against cp=1 on
# the same 2 cores"). cuda: an H100 (989 TFLOP/s dense
# bf16) with 400 Gb/s InfiniBand per GPU, the Meta paper's setting.
HARDWARE_ESTIMATES = {"cpu": (6.5e10, 6e8), "cuda": (989e12, 50e9)}


def choose_ring_variant(
    new_tokens: int,
    cached_tokens: int,
    q_heads: int,
    kv_heads: int,
    cp: int = 1,
    peak_flops: Optional[float] = None,
    link_bytes_per_s: Optional[float] = None,
    elem_bytes: int = 2,
) -> str:
    """Pass-KV or pass-Q for one prefill, after the Meta context-parallelism paper.

    Pass-KV moves (new + cached) tokens x 2 x kv_heads per ring step, pass-Q moves new tokens x
    q_heads (and returns as many partial outputs at the end). Pass-KV wins when the new tokens'
    share of the context is at least 2 * kv_heads / q_heads (its transfer is no larger), or,
    given the hardware numbers, when its transfer hides behind each step's compute anyway:
    new tokens per rank >= C * e * kv_heads / (2 * q_heads * BW). Otherwise pass-Q.
    """
    if new_tokens < 0 or cached_tokens < 0 or q_heads < 1 or kv_heads < 1:
        raise RingAttentionError(f"bad counts: new {new_tokens}, cached {cached_tokens}, heads {q_heads}/{kv_heads}")
    total = new_tokens + cached_tokens
    if total == 0 or new_tokens / total >= 2 * kv_heads / q_heads:
        return "pass-kv"
    if peak_flops and link_bytes_per_s:
        hidden_from = peak_flops * elem_bytes * kv_heads / (2 * q_heads * link_bytes_per_s)
        if new_tokens / max(1, cp) >= hidden_from:
            return "pass-kv"
    return "pass-q"

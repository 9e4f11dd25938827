"""The pass-KV / pass-Q heuristic (the Meta paper's threshold, and enough tokens per rank to hide
the KV transfer)."""

from __future__ import annotations

import pytest

from dist_infer.parallel.ring.errors import RingAttentionError
from dist_infer.parallel.ring.variant import choose_ring_variant


def test_choose_ring_variant():
    # fresh prefill: all new, pass-KV always
    assert choose_ring_variant(65536, 0, 32, 8) == "pass-kv"
    # the Meta paper's threshold: new share >= 2 * kv / q heads (here 0.5) -> pass-KV
    assert choose_ring_variant(500, 500, 32, 8) == "pass-kv"
    assert choose_ring_variant(400, 600, 32, 8) == "pass-q"
    # a short follow-up on a long cache: pass-Q
    assert choose_ring_variant(128, 128_000, 32, 8) == "pass-q"
    # MHA: KV is twice the size of Q, pass-KV only when all tokens are new
    assert choose_ring_variant(999, 1, 8, 8) == "pass-q"
    # enough new tokens per rank to hide the KV transfer behind compute: pass-KV anyway
    c, bw = 400e12, 50e9  # FLOP/s, bytes/s -> threshold C * e * kv / (2 * q * BW) = 2000 tokens per rank
    assert choose_ring_variant(8 * 2000, 10**6, 32, 8, cp=8, peak_flops=c, link_bytes_per_s=bw) == "pass-kv"
    assert choose_ring_variant(8 * 1999, 10**6, 32, 8, cp=8, peak_flops=c, link_bytes_per_s=bw) == "pass-q"
    with pytest.raises(RingAttentionError, match="bad counts"):
        choose_ring_variant(-1, 0, 8, 8)

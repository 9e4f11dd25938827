"""The ring's step plan, checked by a ring simulated in one process against attention by the
definition (fp64 within 1e-10): cp 1..5, causal or not, lengths that do not divide, GQA, both
variants, a cached prefix beside a fresh prompt.

The ring itself as real multi-process jobs: tests/integration/test_ring_attention_jobs.py.
"""

from __future__ import annotations

import pytest
import torch

from dist_infer.parallel.ring.layout import RingLayout
from dist_infer.parallel.ring.lse import merge_many
from dist_infer.parallel.ring.ring_loops import _attend_blocks
from dist_infer.parallel.ring.shards import zigzag_chunks
from tests.support.attention_reference import exact_attention


def simulate(q, k, v, layout: RingLayout, q_rows, k_rows, variant, causal):
    """Every rank's planned ring steps run in one process; returns the whole sequence's output.

    q_rows[r] / k_rows[r]: which rows of the full q / k, v rank r holds. Each step's blocks
    are attended into a fresh partial for the queries' owner; the owner merges its partials.
    """
    n, scale = layout.cp, q.shape[-1] ** -0.5
    partials = {owner: [] for owner in range(n)}
    for r in range(n):
        for i, blocks in enumerate(layout.steps(r, variant, causal)):
            src = (r - i) % n
            owner, keys = (r, src) if variant == "pass-kv" else (src, r)
            o = torch.zeros(len(q_rows[owner]), q.shape[1], q.shape[2], dtype=torch.float64)
            lse = torch.full((len(q_rows[owner]), q.shape[1]), float("-inf"), dtype=torch.float64)
            _attend_blocks(q[q_rows[owner]], k[k_rows[keys]], v[k_rows[keys]], blocks, o, lse, scale)
            partials[owner].append((o, lse))
    out = torch.zeros(q.shape, dtype=torch.float64)
    for owner, parts in partials.items():
        out[q_rows[owner]] = merge_many(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))[0]
    return out


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal", [True, False])
def test_planned_ring_equals_attention_fp64(cp, causal):
    gen = torch.Generator().manual_seed(cp)
    for seq_len in (1, 3, 7, 37, 64, 101):
        q = torch.randn(seq_len, 4, 8, generator=gen, dtype=torch.float64)
        k = torch.randn(seq_len, 2, 8, generator=gen, dtype=torch.float64)
        v = torch.randn(seq_len, 2, 8, generator=gen, dtype=torch.float64)
        want, _ = exact_attention(q, k, v, range(seq_len), range(seq_len), causal)
        rows = [list(zigzag_chunks(seq_len, cp, r).positions) for r in range(cp)]
        layout = RingLayout.zigzag([seq_len], cp)
        for variant in ("pass-kv", "pass-q"):
            got = simulate(q, k, v, layout, rows, rows, variant, causal)
            err = (got - want).abs().max().item()
            assert err < 1e-10, f"seq_len {seq_len} cp {cp} causal {causal} {variant}: error {err:.3g}"


@pytest.mark.parametrize("cp", [2, 3])
def test_planned_ring_with_cached_prefix_and_a_batch(cp):
    # Two sequences: one with 29 cached keys spread round-robin plus 11 new tokens, one fresh of 23.
    gen = torch.Generator().manual_seed(11)
    cached, new, fresh = 29, 11, 23
    k_pos = {0: list(range(cached + new)), 1: list(range(fresh))}
    q_pos = {0: list(range(cached, cached + new)), 1: list(range(fresh))}
    q = {s: torch.randn(len(p), 4, 8, generator=gen, dtype=torch.float64) for s, p in q_pos.items()}
    k = {s: torch.randn(len(p), 2, 8, generator=gen, dtype=torch.float64) for s, p in k_pos.items()}
    v = {s: torch.randn(len(p), 2, 8, generator=gen, dtype=torch.float64) for s, p in k_pos.items()}
    # rank r's rows: flat indices into the concatenation [seq 0 ..., seq 1 ...]
    q_rows, k_rows, qp, kp, qs, ks = [], [], [], [], [], []
    for r in range(cp):
        q0 = [cached + p for p in zigzag_chunks(new, cp, r).positions]
        q1 = list(zigzag_chunks(fresh, cp, r).positions)
        k0 = [p for p in range(cached) if p % cp == r] + q0
        q_rows.append([p - cached for p in q0] + [new + p for p in q1])
        k_rows.append(k0 + [cached + new + p for p in q1])
        qp.append(q0 + q1), kp.append(k0 + q1)
        qs.append([0] * len(q0) + [1] * len(q1)), ks.append([0] * len(k0) + [1] * len(q1))
    layout = RingLayout.from_positions(qp, kp, qs, ks)
    Q, K, V = torch.cat([q[0], q[1]]), torch.cat([k[0], k[1]]), torch.cat([v[0], v[1]])
    want = torch.cat([exact_attention(q[s], k[s], v[s], q_pos[s], k_pos[s], True)[0] for s in (0, 1)])
    for variant in ("pass-kv", "pass-q"):
        got = simulate(Q, K, V, layout, q_rows, k_rows, variant, True)
        assert (got - want).abs().max().item() < 1e-10, variant

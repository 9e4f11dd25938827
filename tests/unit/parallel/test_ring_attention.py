"""Ring attention's pure parts, in this process: the log-sum-exp merge (exact, stable, empty sets),
the zigzag index maps (cover every position once, balanced causal work), the block plan (a ring
simulated in one process against attention by the definition, fp64 within 1e-10, for cp 1..5,
causal or not, lengths that do not divide, GQA, both variants), the variant heuristic, the
attention-with-LSE kernel.

The ring itself as real multi-process jobs: tests/integration/test_ring_attention_jobs.py.
"""

from __future__ import annotations

import pytest
import torch

from dist_infer.parallel.ring.blocks import plan_blocks, ring_step_flops
from dist_infer.parallel.ring.errors import RingAttentionError
from dist_infer.parallel.ring.layout import RingLayout
from dist_infer.parallel.ring.local_attention import attention_with_lse, attention_with_lse_reference
from dist_infer.parallel.ring.lse import merge_into, merge_many, merge_partials
from dist_infer.parallel.ring.ring_loops import _attend_blocks
from dist_infer.parallel.ring.shards import runs_from_positions, zigzag_chunks
from dist_infer.parallel.ring.variant import choose_ring_variant


def exact_attention(q, k, v, q_pos, k_pos, causal, scale=None):
    """fp64 attention by the definition, masked by original positions: (O, LSE)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if causal:
        keep = torch.as_tensor(q_pos)[:, None] >= torch.as_tensor(k_pos)[None, :]
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v.double().repeat_interleave(g, 1))
    return out, lse.transpose(0, 1)


# -- merging -----------------------------------------------------------------------------------

def _partial(scores, values):
    lse = torch.logsumexp(scores, -1)
    return torch.softmax(scores, -1) @ values, lse


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merge_partials_equals_attention_over_the_union(dtype):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 3, 20, generator=gen, dtype=torch.float64) * 4
    values = torch.randn(20, 8, generator=gen, dtype=torch.float64)
    want, want_lse = _partial(scores, values)
    o1, l1 = _partial(scores[..., :7], values[:7])
    o2, l2 = _partial(scores[..., 7:], values[7:])
    o, lse = merge_partials(o1.to(dtype), l1.to(dtype), o2.to(dtype), l2.to(dtype))
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert o.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(o.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def test_merge_into_writes_the_merge_into_views_of_the_accumulators():
    gen = torch.Generator().manual_seed(5)
    acc_o, acc_lse = torch.zeros(6, 3, 4), torch.full((6, 3), float("-inf"))
    o1, l1 = torch.randn(4, 3, 4, generator=gen), torch.randn(4, 3, generator=gen)
    o2, l2 = torch.randn(4, 3, 4, generator=gen), torch.randn(4, 3, generator=gen)
    merge_into(acc_o[1:5], acc_lse[1:5], o1, l1)  # into empty rows: the identity
    assert torch.equal(acc_o[1:5], o1) and torch.equal(acc_lse[1:5], l1)
    merge_into(acc_o[1:5], acc_lse[1:5], o2, l2)
    want_o, want_lse = merge_partials(o1, l1, o2, l2)
    torch.testing.assert_close(acc_o[1:5], want_o, atol=0, rtol=0)
    torch.testing.assert_close(acc_lse[1:5], want_lse, atol=0, rtol=0)
    assert not acc_o[0].any() and not acc_o[5].any() and torch.isneginf(acc_lse[[0, 5]]).all(), "other rows untouched"


def test_merge_partials_empty_sets_are_the_identity():
    o = torch.randn(4, 6)
    lse = torch.randn(4)
    empty_o, empty_lse = torch.zeros(4, 6), torch.full((4,), float("-inf"))
    for a, b in (((o, lse), (empty_o, empty_lse)), ((empty_o, empty_lse), (o, lse))):
        mo, ml = merge_partials(*a, *b)
        assert torch.equal(mo, o) and torch.equal(ml, lse)
    mo, ml = merge_partials(empty_o, empty_lse, empty_o, empty_lse)
    assert torch.equal(mo, empty_o) and torch.isneginf(ml).all(), "two empty sets must stay empty, never NaN"


def test_merge_partials_stable_with_large_log_sum_exps():
    # fp32 with LSEs of magnitude 1e4 (huge logits): the naive exp overflows, the stable form does not.
    o1, o2 = torch.randn(3, 4), torch.randn(3, 4)
    l1 = torch.tensor([10000.0, -10000.0, 50.0])
    l2 = torch.tensor([10001.0, -9999.5, -20000.0])
    o, lse = merge_partials(o1, l1, o2, l2)
    w1 = torch.exp(l1.double() - torch.logaddexp(l1.double(), l2.double()))
    want = w1[:, None] * o1.double() + (1 - w1[:, None]) * o2.double()
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse.double(), torch.logaddexp(l1.double(), l2.double()), atol=1e-3, rtol=1e-7)


def test_merge_many_equals_pairwise_merges_in_any_order():
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(4, 6, 2, 5, generator=gen, dtype=torch.float64)
    lse = torch.randn(4, 6, 2, generator=gen, dtype=torch.float64) * 3
    lse[2, 1] = float("-inf")  # one partial empty for some rows
    lse[:, 4, 0] = float("-inf")  # every partial empty for one row
    o[:, 4, 0] = 0
    mo, ml = merge_many(o, lse)
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        po, pl = o[order[0]], lse[order[0]]
        for i in order[1:]:
            po, pl = merge_partials(po, pl, o[i], lse[i])
        torch.testing.assert_close(mo, po, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(ml, pl, atol=1e-12, rtol=1e-12)
    assert torch.isneginf(ml[4, 0]) and not torch.isnan(mo).any()


# -- zigzag --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_zigzag_covers_every_position_once(cp):
    for seq_len in range(0, 43):
        shards = [zigzag_chunks(seq_len, cp, r) for r in range(cp)]
        held = sorted(p for s in shards for p in s.positions)
        assert held == list(range(seq_len)), f"seq_len {seq_len}, cp {cp}"
        chunk = shards[0].chunk
        assert 2 * cp * chunk >= seq_len > 2 * cp * (chunk - 1) or seq_len == 0
        for r, s in enumerate(shards):
            assert s.chunks == (r, 2 * cp - 1 - r)
            want = [p for c in s.chunks for p in range(c * chunk, (c + 1) * chunk) if p < seq_len]
            assert list(s.positions) == want
            assert s.num_rows + s.padding == 2 * chunk
        assert sum(s.padding for s in shards) == 2 * cp * chunk - seq_len
        for s in shards:
            assert s.runs(3, 5) == runs_from_positions(s.positions, 3, 5)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(cp):
    seq_len = 2 * cp * 16
    work = [sum(p + 1 for p in zigzag_chunks(seq_len, cp, r).positions) for r in range(cp)]
    assert len(set(work)) == 1, f"causal query-key pairs per rank {work} should be equal"
    steps = [[ring_step_flops(blocks, 1, 1) for blocks in RingLayout.zigzag([seq_len], cp).steps(r, "pass-kv")]
             for r in range(cp)]
    for i in range(1, cp):  # every off-diagonal ring step is half a block on every rank
        assert len({s[i] for s in steps}) == 1, f"step {i}: work per rank {[s[i] for s in steps]}"


def test_zigzag_rejects_bad_ranks():
    with pytest.raises(RingAttentionError, match="rank 2 is not a rank of a cp group of 2"):
        zigzag_chunks(10, 2, 2)


# -- the block plan, checked by a ring simulated in one process -------------------------------------

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


def test_plan_blocks_are_square_when_causal_and_skip_invisible_keys():
    q_runs = runs_from_positions([10, 11, 12, 13, 14, 15])
    k_runs = runs_from_positions([4, 5, 6, 12, 13, 14, 15, 16, 17], row=0)  # two runs: 4..6 and 12..17
    blocks = plan_blocks(q_runs, k_runs, causal=True)
    for b in blocks:
        if b.causal:
            assert b.q1 - b.q0 == b.k1 - b.k0
    seen = {(qi, ki) for b in blocks for qi in range(b.q0, b.q1)
            for ki in range(b.k0, b.k1) if not b.causal or ki - b.k0 <= qi - b.q0}
    want = {(qi, ki) for qi, qp in enumerate([10, 11, 12, 13, 14, 15])
            for ki, kp in enumerate([4, 5, 6, 12, 13, 14, 15, 16, 17]) if kp <= qp}
    assert seen == want
    assert plan_blocks(runs_from_positions([0, 1]), runs_from_positions([5, 6]), causal=True) == []


# -- the heuristic -------------------------------------------------------------------------------

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


def test_choose_cp_size_gives_every_rank_its_floor_of_the_longest_prompt():
    from dist_infer.parallel.ring.sizing import MIN_TOKENS_PER_CP_RANK as m, choose_cp_size

    assert choose_cp_size(2 * m - 1, 8) == 1, "two ranks would get less than the floor each"
    assert choose_cp_size(2 * m, 8) == 2
    assert choose_cp_size(3 * m + 5, 8) == 3, "any size, not only powers of two"
    assert choose_cp_size(1 << 20, 2) == 2, "never more than the ranks there are"
    assert choose_cp_size(0, 4) == 1
    assert choose_cp_size(9000, 4, min_tokens_per_rank=1000) == 4
    with pytest.raises(RingAttentionError, match="-5-token prompt"):
        choose_cp_size(-5, 2)


# -- the kernel ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_lse_matches_the_definition(dtype, tol, causal):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(37, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(37, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(37, 2, 16, generator=gen, dtype=torch.float64)
    want, want_lse = exact_attention(q, k, v, range(37), range(37), causal)
    for fn in (attention_with_lse, attention_with_lse_reference):
        o, lse = fn(q.to(dtype), k.to(dtype), v.to(dtype), causal, 0.25)
        assert o.dtype == dtype and tuple(lse.shape) == (37, 4)
        torch.testing.assert_close(o.double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)


def test_attention_with_lse_refuses_empty_blocks():
    with pytest.raises(RingAttentionError, match="0 keys"):
        attention_with_lse(torch.randn(3, 2, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 8))

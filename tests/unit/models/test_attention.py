"""Paged attention against a naive fp64 reference: sequences growing step by step in a shuffled
paged cache (prefill, decode, chunked prefill beside a fresh prompt, GQA and MQA, a sliding
window), and every key written at its slot."""

from __future__ import annotations

import pytest
import torch

from dist_infer.engine.kv_cache import blocks_for
from dist_infer.models.attention import paged_attention
from dist_infer.models.attention_metadata import build_attention_metadata


def _naive(q, keys, values, scale, window=None):
    """One sequence: q [n, H, d] are the last n positions of keys/values [s, KV, d]."""
    n, H, d = q.shape
    s, KV, _ = keys.shape
    rep = H // KV
    k = keys.repeat_interleave(rep, dim=1)
    v = values.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(s - n, s)[:, None]
    kpos = torch.arange(s)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, H * d)


class _PagedRun:
    """Sequences growing step by step in a shuffled paged cache, checked against _naive."""

    def __init__(self, H, KV, d, block_size=4, num_blocks=32, window=None, seed=0):
        self.H, self.KV, self.d, self.bs, self.window = H, KV, d, block_size, window
        self.gen = torch.Generator().manual_seed(seed)
        self.k_cache = torch.zeros(num_blocks, block_size, KV, d, dtype=torch.float64)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.free = torch.randperm(num_blocks, generator=self.gen).tolist()  # non-contiguous tables
        self.tables, self.hist_k, self.hist_v = {}, {}, {}
        self.scale = d**-0.5

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def step(self, seqs: list[int], q_lens: list[int]) -> None:
        tables, seq_lens, qs, ks, vs = [], [], [], [], []
        for s, n in zip(seqs, q_lens):
            old = len(self.hist_k.get(s, []))
            table = self.tables.setdefault(s, [])
            while len(table) < blocks_for(old + n, self.bs):
                table.append(self.free.pop())
            tables.append(list(table))
            seq_lens.append(old + n)
            q, k, v = self._rand(n, self.H, self.d), self._rand(n, self.KV, self.d), self._rand(n, self.KV, self.d)
            qs.append(q), ks.append(k), vs.append(v)
            self.hist_k[s] = torch.cat([self.hist_k[s], k]) if s in self.hist_k else k
            self.hist_v[s] = torch.cat([self.hist_v[s], v]) if s in self.hist_v else v
        meta = build_attention_metadata(q_lens, seq_lens, tables, self.bs, self.window)
        out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), self.k_cache, self.v_cache, meta, self.scale)
        assert out.shape == (sum(q_lens), self.H * self.d)
        assert torch.isfinite(out).all()
        start = 0
        for s, n, q in zip(seqs, q_lens, qs):
            want = _naive(q, self.hist_k[s], self.hist_v[s], self.scale, self.window)
            torch.testing.assert_close(
                out[start : start + n],
                want,
                atol=1e-10,
                rtol=1e-10,
                msg=lambda m, s=s: f"sequence {s} (q_lens {q_lens}, seq_lens {seq_lens}): {m}",
            )
            start += n
        for s, table in zip(seqs, tables):  # the cache holds every key at its slot
            flat = self.k_cache.view(-1, self.KV, self.d)
            slots = [table[p // self.bs] * self.bs + p % self.bs for p in range(len(self.hist_k[s]))]
            assert torch.equal(flat[slots], self.hist_k[s])


@pytest.mark.parametrize("H,KV", [(4, 4), (4, 2), (8, 1)])
def test_paged_attention_matches_naive(H, KV):
    run = _PagedRun(H, KV, d=8)
    run.step([0, 1, 2], [5, 3, 5])  # prefill, fresh, uniform-ish lengths mixed
    run.step([0, 1, 2], [1, 1, 1])  # decode with cache
    run.step([0, 1, 2], [1, 1, 1])
    run.step([0, 2], [1, 1])  # a sequence dropped out
    run.step([1, 3], [4, 7])  # chunked prefill next to a fresh prompt: mixed cached/fresh
    run.step([3, 0, 1], [1, 1, 1])


def test_paged_attention_uniform_fresh_prefill():
    run = _PagedRun(4, 2, d=8)
    run.step([0, 1], [6, 6])  # the mask-free is_causal path
    run.step([0, 1], [1, 1])


@pytest.mark.parametrize("window", [1, 3, 5])
def test_paged_attention_sliding_window(window):
    run = _PagedRun(4, 2, d=8, window=window)
    run.step([0, 1], [7, 7])
    run.step([0, 1], [1, 1])
    run.step([0, 1], [3, 1])
    run.step([2, 0], [2, 1])

"""The routing math, no processes: softmax then top-k (renormalized or not, in fp32 whatever the
logits' dtype, of no tokens), the contiguous token chunks, and the dispatch order (by rank, then
expert, keeping token order)."""

from __future__ import annotations

import pytest
import torch

from dist_infer.parallel.moe.routing import dispatch_order, token_chunk, topk_routing


def test_topk_routing_is_softmax_then_topk():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 4.0]])
    w, e = topk_routing(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert e.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(w, probs.gather(1, e))
    w_norm, e_norm = topk_routing(logits, 2, renormalize=True)
    assert torch.equal(e_norm, e)
    torch.testing.assert_close(w_norm.sum(-1), torch.ones(2))
    torch.testing.assert_close(w_norm, w / w.sum(-1, keepdim=True))
    assert w.dtype == torch.float32


def test_topk_routing_in_fp32_for_bf16_logits():
    w, _ = topk_routing(torch.randn(3, 8, dtype=torch.bfloat16), 2, True)
    assert w.dtype == torch.float32


def test_topk_routing_of_no_tokens():
    w, e = topk_routing(torch.empty(0, 8), 2, True)
    assert w.shape == e.shape == (0, 2)


@pytest.mark.parametrize("total,parts", [(0, 2), (1, 4), (3, 4), (7, 2), (62, 4), (8, 8)])
def test_token_chunk_covers_the_tokens_contiguously(total, parts):
    chunks = [token_chunk(total, parts, r) for r in range(parts)]
    assert sum(n for _, n in chunks) == total
    assert all(chunks[r][0] + chunks[r][1] == chunks[r + 1][0] for r in range(parts - 1))
    assert chunks[0][0] == 0
    assert max(n for _, n in chunks) - min(n for _, n in chunks) <= 1


def test_dispatch_order_groups_by_rank_then_expert_keeping_token_order():
    owner = torch.tensor([1, 0, 1, 0])  # experts 1 and 3 on rank 0
    experts = torch.tensor([[2, 1], [3, 1], [0, 2]])  # pairs 0..5
    order = dispatch_order(experts, owner).tolist()
    flat = experts.reshape(-1).tolist()
    assert [flat[i] for i in order] == [1, 1, 3, 0, 2, 2]
    assert order == [1, 3, 2, 4, 0, 5]  # within an expert, the earlier token first

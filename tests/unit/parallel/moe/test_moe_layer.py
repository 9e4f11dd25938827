"""The whole dispatch/combine layer with its ep (and tp) ranks played by threads.

The threads talk through `ThreadComm` (tests/support/threads.py), a Communicator whose
collectives meet at a barrier in this process, so the layer's real all-gather / all-to-all /
all-reduce calls run unchanged. The reference is the experts applied densely, token by token,
from the full weights (tests/support/moe_reference.py).
"""

from __future__ import annotations

import pytest
import torch

from dist_infer.comm.groups import ParallelGroups
from dist_infer.parallel.moe.layer import ExpertParallelMoE
from dist_infer.parallel.moe.placement import ExpertPlacement
from dist_infer.parallel.sharding import ShardingError
from tests.support.moe_reference import E, H, I, K, dense_reference, expert_weights
from tests.support.threads import run_ranks, thread_groups


def build_layer(g: ParallelGroups, w, placement=None, fused=False, renormalize=True) -> ExpertParallelMoE:
    placement = placement or ExpertPlacement.contiguous(E, g.ep.size)
    layer = ExpertParallelMoE(H, I, E, K, renormalize, placement, g.tp, g.ep)
    layer.gate_loader(w["gate"])
    if fused:
        layer.experts.load_fused(torch.cat([w["w1"], w["w3"]], dim=1), w["w2"], E)
    else:
        for e in layer.experts.experts:
            layer.experts.load_expert(e, w["w1"][e], w["w3"][e], w["w2"][e])
    return layer


@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2), (1, 4), (2, 2), (2, 1)])
@pytest.mark.parametrize("tokens", [1, 3, 13])
def test_layer_matches_dense_experts(tp, ep, tokens):
    w = expert_weights()
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    want = dense_reference(x, w)
    outs = run_ranks(thread_groups(tp, ep), lambda g: build_layer(g, w)(x))
    for r, got in enumerate(outs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {r} of tp={tp} ep={ep}: {m}")


def test_layer_partial_is_the_unreduced_sum():
    w = expert_weights(1)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0))
    partials = run_ranks(thread_groups(2, 2), lambda g: build_layer(g, w).partial(x))
    torch.testing.assert_close(partials[0] + partials[1], dense_reference(x, w), atol=1e-5, rtol=1e-5)


def test_layer_with_every_token_sent_to_one_rank():
    """Dropless under the worst skew: the router picks experts 6 and 7 (rank 3's) for every token."""
    w = expert_weights(2)
    w["gate"][:6] = -50.0 * w["gate"][6:].abs().sum(0)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3)).abs()  # positive: rows 6, 7 win
    want = dense_reference(x, w)

    def body(g):
        layer = build_layer(g, w)
        return layer(x), layer.stats.last

    outs = run_ranks(thread_groups(1, 4), body)
    for got, last in outs:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert last["tokens_per_rank"] == [0.0, 0.0, 0.0, 18.0] and last["imbalance"] == 4.0


def test_layer_with_a_scattered_placement_and_fused_weights():
    w = expert_weights(3)
    placement = ExpertPlacement((1, 0, 0, 1, 1, 0, 1, 0), 2)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(4))
    want = dense_reference(x, w, renormalize=False)

    def body(g):
        layer = build_layer(g, w, placement, fused=True, renormalize=False)
        assert layer.experts.experts == placement.local_experts(g.ep.rank)
        return layer(x), layer.stats.summary()

    for got, summary in run_ranks(thread_groups(1, 2), body):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert sum(summary["tokens_per_expert"]) == 11 * K


def test_layer_rejects_a_placement_for_another_ep():
    g = thread_groups(1, 1)[0]
    with pytest.raises(ShardingError, match="placement for 8 experts over ep=2, the layer has 8 experts over ep=1"):
        ExpertParallelMoE(H, I, E, K, True, ExpertPlacement.contiguous(E, 2), g.tp, g.ep)

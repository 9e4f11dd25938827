"""Expert parallelism without processes: the routing math, placement, the routing file, statistics,
and the whole dispatch/combine layer with its ep (and tp) ranks played by threads.

The threads talk through `ThreadComm` (tests/support/threads.py), a Communicator whose
collectives meet at a barrier in this process, so the layer's real all-gather / all-to-all /
all-reduce calls run unchanged. The reference is the experts applied densely, token by token,
from the full weights.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from checkpoints import hf_reference
from threads import run_ranks, thread_groups

from dist_infer.comm.groups import ParallelGroups
from dist_infer.models.config import ModelConfig, ModelConfigError
from dist_infer.parallel.moe.layer import ExpertParallelMoE
from dist_infer.parallel.moe.placement import ExpertPlacement, balanced_placement, imbalance
from dist_infer.parallel.moe.routing import dispatch_order, token_chunk, topk_routing
from dist_infer.parallel.moe.routing_file import read_placement_file, write_routing_file
from dist_infer.parallel.moe.stats import RoutingStats
from dist_infer.parallel.sharding import ShardingError

# -- routing math --------------------------------------------------------------------------------

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


def test_imbalance():
    assert imbalance([5, 5]) == 1.0
    assert imbalance([10, 0, 0, 0]) == 4.0
    assert imbalance([0, 0]) == 1.0
    assert imbalance([3, 1]) == 1.5


# -- placement -------------------------------------------------------------------------------------

def test_contiguous_placement():
    p = ExpertPlacement.contiguous(8, 4)
    assert p.owner == (0, 0, 1, 1, 2, 2, 3, 3)
    assert p.local_experts(2) == [4, 5]
    assert p.rank_loads([1, 2, 3, 4, 5, 6, 7, 8]) == [3, 7, 11, 15]


@pytest.mark.parametrize("owner,ep,needle", [
    ((0, 0, 1), 2, "3 experts cannot be split evenly over ep=2 (3 % 2 = 1)"),
    ((0, 0, 0, 1), 2, "gives the 2 ranks [3, 1] experts; each must own 2"),
    ((0, 2, 1, 1), 2, "names ranks [2] outside ep=2"),
])
def test_placement_errors_name_the_numbers(owner, ep, needle):
    with pytest.raises(ShardingError) as exc:
        ExpertPlacement(owner, ep)
    assert needle in str(exc.value)


def test_contiguous_placement_error():
    with pytest.raises(ShardingError, match=r"6 experts cannot be split evenly over ep=4 \(6 % 4 = 2\)"):
        ExpertPlacement.contiguous(6, 4)


def test_balanced_placement_evens_out_a_skew():
    counts = [100, 90, 10, 5, 4, 3, 2, 1]  # contiguous over 2: [205, 10]
    owner = balanced_placement(counts, 2)
    p = ExpertPlacement(tuple(owner), 2)  # validates: 4 experts per rank
    loads = p.rank_loads(counts)
    assert imbalance(loads) < imbalance(ExpertPlacement.contiguous(8, 2).rank_loads(counts))
    assert max(loads) == 108  # the optimum: 215 tokens, {100, 4, 3, 1} vs {90, 10, 5, 2}
    assert balanced_placement(counts, 2) == owner  # deterministic


def test_balanced_placement_swaps_past_greedy():
    # LPT alone gives {8, 5, 4} = 17 vs {7, 6, 1} = 14; a swap reaches 16 vs 15.
    counts = [8, 7, 6, 5, 4, 1]
    loads = ExpertPlacement(tuple(balanced_placement(counts, 2)), 2).rank_loads(counts)
    assert sorted(loads) == [15, 16]


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_balanced_placement_random_counts(ep):
    gen = torch.Generator().manual_seed(ep)
    counts = (torch.rand(16, generator=gen) ** 4 * 1000).round().tolist()
    p = ExpertPlacement(tuple(balanced_placement(counts, ep)), ep)
    lpt_bound = sum(counts) / ep + max(counts)
    assert max(p.rank_loads(counts)) <= lpt_bound
    assert imbalance(p.rank_loads(counts)) <= imbalance(ExpertPlacement.contiguous(16, ep).rank_loads(counts)) + 1e-9


def test_balanced_placement_rejects_uneven_split():
    with pytest.raises(ShardingError, match="5 experts cannot be split evenly over ep=2"):
        balanced_placement([1, 2, 3, 4, 5], 2)


def test_routing_file_round_trip(tmp_path):
    counts = {0: [100, 90, 10, 5, 4, 3, 2, 1], 3: [1, 1, 1, 1, 1, 1, 1, 50]}
    path = tmp_path / "routing.json"
    data = write_routing_file(path, counts, ep=2)
    on_disk = json.loads(path.read_text())
    assert on_disk["counts"]["0"] == [100, 90, 10, 5, 4, 3, 2, 1]
    assert on_disk["imbalance_balanced"]["0"] < on_disk["imbalance_contiguous"]["0"]
    same_ep = read_placement_file(path, 8, 2)
    assert same_ep[0].owner == tuple(data["placement"]["0"]) and set(same_ep) == {0, 3}
    other_ep = read_placement_file(path, 8, 4)  # recomputed from the counts
    assert other_ep[0].owner == tuple(balanced_placement(counts[0], 4))
    with pytest.raises(ValueError, match="for 8 experts per layer, the model has 16"):
        read_placement_file(path, 16, 2)
    (tmp_path / "bad.json").write_text('{"kind": "something else"}')
    with pytest.raises(ValueError, match="not an expert routing file"):
        read_placement_file(tmp_path / "bad.json", 8, 2)


def test_routing_stats():
    stats = RoutingStats(ExpertPlacement.contiguous(4, 2))
    stats.record(torch.tensor([3, 1, 0, 0]))
    stats.record(torch.tensor([1, 1, 1, 1]))
    assert stats.last == {"tokens_per_expert": [1.0, 1.0, 1.0, 1.0], "tokens_per_rank": [2.0, 2.0], "imbalance": 1.0}
    s = stats.summary()
    assert s["steps"] == 2 and s["tokens_per_expert"] == [4.0, 2.0, 1.0, 1.0] and s["tokens_per_rank"] == [6.0, 2.0]
    assert s["step_imbalance_max"] == 2.0 and s["step_imbalance_mean"] == 1.5 and s["imbalance"] == 1.5
    assert list(stats.history) == [[4.0, 0.0], [2.0, 2.0]]
    stats.reset()
    assert stats.steps == 0 and not stats.history


# -- config ---------------------------------------------------------------------------------------

_MOE_BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=128, intermediate_size=96,
                 num_experts_per_tok=2)


def test_config_mixtral():
    cfg = ModelConfig.from_hf({**_MOE_BASE, "model_type": "mixtral", "num_local_experts": 8})
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.qk_norm) == (8, 96, True, False)
    assert all(cfg.is_moe_layer(i) for i in range(4))


def test_config_qwen2_moe_layers_and_shared_expert():
    cfg = ModelConfig.from_hf({**_MOE_BASE, "model_type": "qwen2_moe", "num_experts": 8, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert cfg.shared_expert_intermediate_size == 48
    assert (cfg.norm_topk_prob, cfg.qkv_bias, cfg.o_bias) == (False, True, False)


def test_config_qwen3_moe():
    cfg = ModelConfig.from_hf({**_MOE_BASE, "model_type": "qwen3_moe", "num_local_experts": 8,
                               "moe_intermediate_size": 32, "norm_topk_prob": True})
    assert (cfg.num_experts, cfg.qk_norm, cfg.norm_topk_prob, cfg.qkv_bias) == (8, True, True, False)


def test_config_dense_has_no_experts():
    cfg = ModelConfig.from_hf({**_MOE_BASE, "model_type": "llama"})
    assert cfg.num_experts == 0 and not cfg.is_moe_layer(0)


@pytest.mark.parametrize("extra,needle", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be between 1 and the 8 experts"),
])
def test_config_errors(extra, needle):
    with pytest.raises(ModelConfigError, match=needle):
        ModelConfig.from_hf({**_MOE_BASE, "model_type": "mixtral", "num_local_experts": 8, **extra})


# -- the layer --------------------------------------------------------------------------------------

H, I, E, K = 16, 24, 8, 2


def _weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"gate": torch.randn(E, H, generator=gen), "w1": torch.randn(E, I, H, generator=gen) * 0.3,
            "w3": torch.randn(E, I, H, generator=gen) * 0.3, "w2": torch.randn(E, H, I, generator=gen) * 0.3}


def dense_reference(x, w, renormalize=True):
    """Every token through its top-k experts, one at a time, from the full weights."""
    weights, experts = topk_routing(F.linear(x, w["gate"]), K, renormalize)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(experts[t, j])
            h = F.silu(w["w1"][e] @ x[t]) * (w["w3"][e] @ x[t])
            out[t] += weights[t, j] * (w["w2"][e] @ h)
    return out


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
    w = _weights()
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    want = dense_reference(x, w)
    outs = run_ranks(thread_groups(tp, ep), lambda g: build_layer(g, w)(x))
    for r, got in enumerate(outs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {r} of tp={tp} ep={ep}: {m}")


def test_layer_partial_is_the_unreduced_sum():
    w = _weights(1)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(0))
    partials = run_ranks(thread_groups(2, 2), lambda g: build_layer(g, w).partial(x))
    torch.testing.assert_close(partials[0] + partials[1], dense_reference(x, w), atol=1e-5, rtol=1e-5)


def test_layer_with_every_token_sent_to_one_rank():
    """Dropless under the worst skew: the router picks experts 6 and 7 (rank 3's) for every token."""
    w = _weights(2)
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
    w = _weights(3)
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


class _Recording:
    """A weight source that records which rows of which expert were read (like a lazy checkpoint slice)."""

    def __init__(self, tensor, log):
        self.tensor, self.shape, self.log = tensor, tuple(tensor.shape), log

    def __getitem__(self, index):
        self.log.append(index)
        return self.tensor[index]


def test_fused_loader_reads_only_this_ranks_experts_and_rows():
    w = _weights(4)
    log: list = []
    gate_up = _Recording(torch.cat([w["w1"], w["w3"]], dim=1), log)
    down = _Recording(w["w2"], log)

    def body(g):
        layer = ExpertParallelMoE(H, I, E, K, True, ExpertPlacement.contiguous(E, 4), g.tp, g.ep)
        if g.ep.rank == 1 and g.tp.rank == 1:
            layer.experts.load_fused(gate_up, down, E)
        return None

    run_ranks(thread_groups(2, 4), body)
    experts = {ix[0].start for ix in log}
    assert experts == {2, 3}, f"rank ep1/tp1 owns experts 2 and 3, read {sorted(experts)}"
    assert all(ix[0].stop - ix[0].start == 1 for ix in log)
    rows = {(ix[1].start, ix[1].stop) for ix in log if len(ix) == 3 and ix[1] != slice(None)}
    assert rows == {(12, 24), (36, 48)}, rows  # the second half of gate rows and of up rows (I=24, tp=2)


# -- a whole model, ranks as threads ------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_in_memory_transformers_model_over_two_ep_threads(arch, tmp_path):
    """stage_from_hf_model reads transformers' fused in-memory expert tensors; ep=2 gives HF's logits."""
    from checkpoints import load_hf_model, write_hf_checkpoint

    from dist_infer.engine.engine_core import Engine
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.models.loader import stage_from_hf_model

    hf = load_hf_model(write_hf_checkpoint(tmp_path, arch))
    assert any("experts.gate_up_proj" in n for n, _ in hf.named_parameters()), "expected fused experts in memory"
    prompts = [[5, 9, 17, 3, 44], [7] * 12]
    ref_ids, ref_logits = hf_reference(None, prompts, 4, model=hf)

    def body(g):
        engine = Engine(stage_from_hf_model(hf, g), g)
        return engine.generate(prompts, SamplingParams(max_new_tokens=4, stop_at_eos=False), return_logits=True)

    for outputs in run_ranks(thread_groups(1, 2), body):
        for b, out in enumerate(outputs):
            assert out.token_ids == ref_ids[b]
            torch.testing.assert_close(torch.stack(out.logits), ref_logits[b], atol=1e-4, rtol=1e-4)


def test_dense_model_refuses_expert_options():
    from dist_infer.models.registry import builder_for

    cfg = ModelConfig.from_hf({**_MOE_BASE, "model_type": "llama"})
    g = thread_groups(1, 1)[0]
    with pytest.raises(ModelConfigError, match="has no experts"):
        builder_for("llama")(cfg, g, range(0, 4), True, True, torch.float32, expert_placement="x.json")

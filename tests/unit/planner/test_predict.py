"""The predicted schedule on a profile with only the costs a test asks for, against hand-computed
values: GEMMs and the pipeline fill, tp all-reduces and their overlap, ring transfers, measured
fixed costs, KV and weight reads at the rates measured for their sizes, attention at the rate for
its head size; and Meta's published context-parallel prefills of Llama 3 405B (arXiv 2411.01783)
from hardware figures alone. (The CLI on a small config, calibrate, and a two-layout sweep in real
processes: tests/integration/test_planner_cli.py.)"""

from __future__ import annotations

import pytest

from dist_infer.planner.hardware import HardwareProfile, Link, load_profile
from dist_infer.planner.layout import Layout
from dist_infer.planner.predict import predict
from dist_infer.planner.shapes import causal_attention_flops
from dist_infer.planner.workload import Schedule, Workload, micro_batches
from tests.support.plan_profiles import BIG, LLAMA3_405B, SMALL, gemm_only_profile


# -- schedule arithmetic ------------------------------------------------------------------------
def test_gemm_time_and_pipeline_fill():
    """Only GEMMs cost: prefill of B sequences = 2 x params x tokens / rate, but the model's last
    layer projects keys, values (and, off the CPU kernels, queries) for every token and runs
    o_proj and the MLP on each sequence's last row only. With pp=2 the batch goes as 2
    micro-batches: the first crosses both stages, the second follows one slowest stage (the
    last: its layers and the LM head) later."""
    hw = gemm_only_profile()
    work = Workload(batch=2, prompt_len=10, gen_len=2)
    layer = SMALL.attention_params() + SMALL.dense_mlp_params()
    linear = SMALL.layers * layer
    every_row = 64 * 2 * 16 * 2 + 64 * 4 * 16  # k, v; q
    last_rows = layer - every_row  # o_proj and the MLP

    def last_layer(seqs: int, tokens: int) -> float:
        return 2 * (every_row * tokens + last_rows * seqs) / 1e9

    head = SMALL.vocab * SMALL.hidden  # the LM head on each sampled row
    one = predict(SMALL, Layout(), work, hw)
    assert one.ttft_s == pytest.approx((2 * (linear - layer) * 20 + 2 * head * 2) / 1e9 + last_layer(2, 20))
    two = predict(SMALL, Layout(pp=2), work, hw)
    half = 2 * linear / 2 * 10 / 1e9  # one stage's layers on one 10-token sequence
    head1 = 2 * head / 1e9  # the LM head on one row
    last = half - 2 * layer * 10 / 1e9 + last_layer(1, 10) + head1  # the last stage on one sequence
    assert micro_batches(2, 2) == 2
    assert last < half  # so the first stage is the slowest
    assert two.ttft_s == pytest.approx((half + last) + half)
    assert two.prefill["pp_bubble"] == pytest.approx(half)  # beyond 2 mean stage times (half + last)
    # decode: both micro-batches in flight; the last stage's two passes set the round
    assert two.tpot_s == pytest.approx(2 * (linear / 1e9 + head1))
    # one sequence, two stages: the decode token crosses both, nothing overlaps
    solo = predict(SMALL, Layout(pp=2), Workload(batch=1, prompt_len=10, gen_len=2), hw)
    assert solo.tpot_s == pytest.approx(predict(SMALL, Layout(), Workload(1, 10, 2), hw).tpot_s)


def test_tensor_parallel_all_reduces_and_overlap():
    """Two all-reduces per layer plus the embedding's, each 2(n-1)/n x tokens x hidden x 4 bytes
    over the link; token splitting hides them behind the other half's compute."""
    bw = 1e9
    hw = gemm_only_profile(rate=BIG, links={"intra": Link(0.0, bw), "inter": Link(0.0, bw)})
    work = Workload(batch=1, prompt_len=32, gen_len=2)
    p = predict(SMALL, Layout(tp=2), work, hw, Schedule(overlap="off"))
    per_ar = 2 * 1 / 2 * 32 * 64 * 4 / bw
    gather = 1 / 2 * 1 * 100 * 4 / bw  # the LM head's logits all-gather
    last_rows = 2 * 2 * 1 / 2 * 1 * 64 * 4 / bw  # the last layer's two all-reduces, on the sampled row only
    assert p.prefill["tp_comm"] == pytest.approx((2 * (SMALL.layers - 1) + 1) * per_ar + last_rows + gather)
    slow = gemm_only_profile(rate=1e6, links={"intra": Link(0.0, bw), "inter": Link(0.0, bw)})
    hidden = predict(SMALL, Layout(tp=2), work, slow, Schedule(overlap="on"))
    exposed = predict(SMALL, Layout(tp=2), work, slow, Schedule(overlap="off"))
    assert hidden.prefill["tp_comm"] < exposed.prefill["tp_comm"]


def test_ring_transfer_hidden_or_exposed():
    """A cp step costs the longer of its K/V transfer and its compute, plus the LSE merge."""
    work = Workload(batch=1, prompt_len=4096, gen_len=2)
    fast_link = gemm_only_profile(
        attention_flops={"fp32": 1e9}, memory_bandwidth=1e12, links={"intra": Link(0.0, 1e15), "inter": Link(0.0, 1e15)}
    )
    slow_link = gemm_only_profile(
        attention_flops={"fp32": 1e9}, memory_bandwidth=1e12, links={"intra": Link(0.0, 1e5), "inter": Link(0.0, 1e5)}
    )
    hidden = predict(SMALL, Layout(cp=2), work, fast_link)
    exposed = predict(SMALL, Layout(cp=2), work, slow_link)
    # every layer but the last (which attends the last token only, merged by one small gather)
    rings = SMALL.layers - 1
    merge = 3 * 2048 * 4 * 17 * 4 / 1e12 * rings
    assert hidden.prefill["cp_ring"] == pytest.approx(merge, rel=1e-6)
    block = 2048 * 2 * 2 * 16 * 4  # this rank's K and V: 2 KV heads x 16 x fp32
    step_compute = causal_attention_flops(4, 16, 4096) / 2 / 1e9 / 2
    assert block / 1e5 > step_compute
    last_gather = 1 / 2 * 2 * (4 * 16 + 4) * 4 / 1e5
    assert exposed.prefill["cp_ring"] == pytest.approx(rings * (block / 1e5 - step_compute) + merge + last_gather)
    # cp halves each rank's attention in every layer but the last, which attends one query row
    one = predict(SMALL, Layout(), work, fast_link)
    assert hidden.prefill["attention"] == pytest.approx(one.prefill["attention"] / 2 * rings / SMALL.layers, rel=1e-3)


def test_decode_counts_a_layout_s_measured_fixed_costs_instead_of_latencies():
    """A layout that calibrate timed: its decode step costs the measured per-layer and per-step
    fixed costs plus only the bytes over the links; the link latencies (and the single rank's
    fixed costs) are left out, as the measurement holds them. Prefill is unchanged."""
    work = Workload(batch=1, prompt_len=32, gen_len=3)
    base = dict(rate=BIG, links={"intra": Link(5e-3, BIG), "inter": Link(5e-3, BIG)}, per_layer_s=1e-4, per_step_s=2e-3)
    estimated = predict(SMALL, Layout(tp=2), work, gemm_only_profile(**base), Schedule(overlap="off"))
    # every decode all-reduce (2 per layer, the embedding's) and the logits' gather pay the 5 ms latency
    assert estimated.decode["tp_comm"] == pytest.approx((2 * SMALL.layers + 2) * 5e-3)
    timed = gemm_only_profile(**base, decode_fixed={"tp=2": {"per_layer_s": 3e-3, "per_step_s": 7e-3}})
    p = predict(SMALL, Layout(tp=2), work, timed, Schedule(overlap="off"))
    assert p.tpot_s == pytest.approx(SMALL.layers * 3e-3 + 7e-3)
    assert p.decode.get("tp_comm", 0.0) == pytest.approx(0.0, abs=1e-12)  # no 5 ms latencies
    assert p.decode["overhead"] == pytest.approx(p.tpot_s)
    assert p.ttft_s == pytest.approx(estimated.ttft_s)
    # another layout, and one rank, keep the per-op estimates
    assert predict(SMALL, Layout(pp=2), work, timed).tpot_s == pytest.approx(
        predict(SMALL, Layout(pp=2), work, gemm_only_profile(**base)).tpot_s
    )
    assert predict(SMALL, Layout(), work, timed).tpot_s == pytest.approx(SMALL.layers * 1e-4 + 2e-3)
    # a pipeline of one sequence: the measured step (its hand-overs) once, every layer once
    piped = gemm_only_profile(**base, decode_fixed={"pp=2": {"per_layer_s": 3e-3, "per_step_s": 7e-3}})
    assert predict(SMALL, Layout(pp=2), work, piped).tpot_s == pytest.approx(SMALL.layers * 3e-3 + 7e-3)


def test_node_reads_kv_at_its_ranks_rates_together():
    """On a CPU node the decode attention kernel may gain nothing from a second thread on one
    sequence (calibrate measured 3.3 GB/s with 1 thread, 3.1 with 2 here), but two ranks read
    their halves side by side: the node bound counts the ranks' own rates together."""
    kv_rates = {"1": [[16, 1e9]], "2": [[16, 1e9]]}  # one process: 1 GB/s, however many threads
    hw = gemm_only_profile(
        rate=BIG,
        device="cpu",
        shared_node=True,
        devices_per_node=2,
        memory_bandwidth={"1": 1e12, "2": 2e12},
        decode_attention_bandwidth=kv_rates,
    )
    work = Workload(batch=1, prompt_len=4096, gen_len=2)
    kv = 4096 * SMALL.layers * SMALL.kv_bytes_per_token(1, 1, 4)  # the whole cache, read once per token
    one = predict(SMALL, Layout(), work, hw, Schedule(ranks_per_node=1, cores_per_node=2))
    two = predict(SMALL, Layout(tp=2), work, hw, Schedule(ranks_per_node=2, cores_per_node=2))
    assert one.tpot_s == pytest.approx(kv / 1e9, rel=0.01)
    assert two.tpot_s == pytest.approx(kv / 2 / 1e9, rel=0.01)  # each rank its half, at the same time
    assert "node_shared" not in two.decode


def test_a_shared_node_pays_a_layout_s_fixed_costs_and_its_ranks_bytes_one_after_the_other():
    """On a CPU node whose ranks fill its cores, the measured fixed costs of a decode round (ranks
    waiting at collectives and hand-overs hold the cores: a wait spins before it sleeps) and the
    bytes every rank streams through the one memory bus add up: cp=2 replicates the weights, so the
    node streams them twice per token, then waits out the layout's fixed costs; with pp=2 and two
    micro-batches, each micro-batch's trip pays them (measured on SmolLM2 here: cp=2 80 ms,
    tp=2 x pp=2 84 ms per token, which the rank's own critical path put at 58 and 47)."""
    streamed = 4 * (SMALL.layers * (SMALL.attention_params() + SMALL.dense_mlp_params()) + 100 * 64)  # + LM head
    trip = SMALL.layers * 1e-3 + 5e-3

    def profile(fixed: dict, node_bw: float = 1e9) -> HardwareProfile:
        return gemm_only_profile(
            rate=BIG,
            device="cpu",
            shared_node=True,
            devices_per_node=2,
            memory_bandwidth={"1": 1e9, "2": node_bw},  # one thread's rate, the node bus's
            decode_fixed={"cp=2": fixed, "tp=2,pp=2": fixed},
        )

    timed, free = profile({"per_layer_s": 1e-3, "per_step_s": 5e-3}), profile({"per_layer_s": 0, "per_step_s": 0})
    one_token = Workload(batch=1, prompt_len=8, gen_len=2)
    sched = Schedule(ranks_per_node=2, cores_per_node=2)
    bytes_only = predict(SMALL, Layout(cp=2), one_token, free, sched)
    # both ranks read all the weights (and the norms' and the cache's few bytes)
    assert bytes_only.tpot_s == pytest.approx(2 * streamed / 1e9, rel=0.05)
    cp = predict(SMALL, Layout(cp=2), one_token, timed, sched)
    assert cp.tpot_s == pytest.approx(trip + bytes_only.tpot_s) and cp.decode["node_shared"] > 0
    # where the node's bus is fast, the rank's own path (its fixed costs, then its weights at its
    # thread's rate) stays the bound
    alone = predict(SMALL, Layout(cp=2), one_token, profile({"per_layer_s": 1e-3, "per_step_s": 5e-3}, 1e11), sched)
    assert alone.tpot_s == pytest.approx(trip + streamed / 1e9, rel=0.05) and "node_shared" not in alone.decode
    # four ranks, two micro-batches of two sequences: each micro-batch's trip pays the fixed costs, and
    # the node streams every stage's shard once per micro-batch
    four, batch4 = Schedule(ranks_per_node=4, cores_per_node=2), Workload(batch=4, prompt_len=8, gen_len=2)
    piped_bytes = predict(SMALL, Layout(tp=2, pp=2), batch4, free, four).tpot_s
    assert piped_bytes == pytest.approx(2 * streamed / 1e9, rel=0.15)  # (+ each rank's norms and activations)
    assert predict(SMALL, Layout(tp=2, pp=2), batch4, timed, four).tpot_s == pytest.approx(2 * trip + piped_bytes)


def test_prefill_counts_a_layout_s_measured_fixed_costs_and_unmasked_ring_blocks_at_their_rate():
    """A cp prefill: only each rank's two zigzag chunks' own triangles are causal, the ring's other
    blocks have no mask and run at the profile's unmasked rate; a layout calibrate timed pays its
    measured prefill fixed costs (ring steps, waits) instead of every link latency."""
    L, cp = 64, 2
    work = Workload(batch=1, prompt_len=L, gen_len=2)
    base = dict(rate=BIG, attention_flops={"fp32": 1e9}, links={"intra": Link(5e-3, BIG), "inter": Link(5e-3, BIG)})
    causal_only = predict(SMALL, Layout(cp=cp), work, gemm_only_profile(**base), Schedule(overlap="off"))
    full = gemm_only_profile(**base, attention_flops_full={"fp32": 4e9})
    split = predict(SMALL, Layout(cp=cp), work, full, Schedule(overlap="off"))
    per_rank = causal_attention_flops(SMALL.heads, SMALL.head_dim, L) / cp
    masked = 2 * causal_attention_flops(SMALL.heads, SMALL.head_dim, L // (2 * cp))  # two chunks' triangles
    layers = SMALL.layers - 1  # (the last layer attends the sampled row only)
    assert causal_only.prefill["attention"] - split.prefill["attention"] == pytest.approx(
        layers * (per_rank - masked) * (1 / 1e9 - 1 / 4e9)
    )
    assert split.prefill["cp_ring"] > layers * 5e-3  # every ring step pays the link's 5 ms latency
    timed = gemm_only_profile(
        **base, attention_flops_full={"fp32": 4e9}, prefill_fixed={"cp=2": {"per_layer_s": 2e-3, "per_step_s": 9e-3}}
    )
    p = predict(SMALL, Layout(cp=cp), work, timed, Schedule(overlap="off"))
    assert p.prefill["overhead"] == pytest.approx(SMALL.layers * 2e-3 + 9e-3)
    assert p.prefill.get("cp_ring", 0.0) < 1e-6  # the latencies are in the measured costs
    assert p.prefill["attention"] == pytest.approx(split.prefill["attention"])
    assert p.tpot_s == pytest.approx(split.tpot_s)  # decode untouched (no decode_fixed for it)


def test_decode_reads_kv_at_the_rate_for_the_rank_s_kv_heads():
    """The native decode attention reads one KV head's rows in one run and several heads' rows
    interleaved (8.8 GB/s against 3.5 here, heads of 32): a calibrated profile has the rate by head
    size and KV heads per rank, and a rank is charged at the rate for the KV heads it holds."""
    kv_rates = {"1": {"16": [[1, 4e9], [2, 1e9]]}}
    hw = gemm_only_profile(rate=BIG, memory_bandwidth=BIG, decode_attention_bandwidth=kv_rates)
    assert hw.kv_bandwidth(1, 16, 1) == 4e9 and hw.kv_bandwidth(1, 16, 2) == 1e9
    assert hw.kv_bandwidth(1, 16, 8) == 1e9  # (flat beyond the measured heads)
    work = Workload(batch=1, prompt_len=4096, gen_len=2)
    kv = 4096 * SMALL.layers * SMALL.kv_bytes_per_token(1, 1, 4)  # the whole cache (2 KV heads)
    assert predict(SMALL, Layout(), work, hw).decode["attention"] == pytest.approx(kv / 1e9, rel=0.01)
    # tp=2: one KV head per rank, half the cache, at the one-head rate
    assert predict(SMALL, Layout(tp=2), work, hw).decode["attention"] == pytest.approx(kv / 2 / 4e9, rel=0.01)
    # a profile from before (by head size only) reads the same rate whatever the heads
    old = gemm_only_profile(rate=BIG, memory_bandwidth=BIG, decode_attention_bandwidth={"1": [[16, 2e9]]})
    assert old.kv_bandwidth(1, 16, 1) == old.kv_bandwidth(1, 16, 2) == 2e9


def test_decode_reads_a_long_context_at_the_rate_measured_for_it():
    """With several KV heads the decode kernel slows once a sequence's cache outgrows the CPU's
    caches (4 heads of 32: 3.8 GB/s at 4K, 3.4 at 8K, 2.4 at 16K): the newest profiles have the
    rate by context too, looked up at the tokens a rank holds per sequence (a cp rank: 1/cp)."""
    kv_rates = {"1": {"16": {"1": [[1024, 4e9]], "2": [[1024, 2e9], [4096, 2e9], [16384, 1e9]]}}}
    hw = gemm_only_profile(rate=BIG, memory_bandwidth=BIG, decode_attention_bandwidth=kv_rates)
    assert hw.kv_bandwidth(1, 16, 2, 4096) == 2e9 and hw.kv_bandwidth(1, 16, 2, 16384) == 1e9
    assert hw.kv_bandwidth(1, 16, 2, 8192) == pytest.approx(1.5e9)  # halfway in log(context)
    assert hw.kv_bandwidth(1, 16, 1, 16384) == 4e9  # one context measured: flat
    assert hw.kv_bandwidth(1, 16, 3, 4096) == 2e9  # beyond the measured heads: flat
    work = Workload(batch=1, prompt_len=16384, gen_len=2)
    kv = (16384 + 1) * SMALL.layers * SMALL.kv_bytes_per_token(1, 1, 4)  # the whole cache (2 KV heads)
    assert predict(SMALL, Layout(), work, hw).decode["attention"] == pytest.approx(kv / 1e9, rel=0.01)
    # cp=4: a quarter of the cache per rank, at the 4K rate (the merge costs nothing here)
    assert predict(SMALL, Layout(cp=4), work, hw).decode["attention"] == pytest.approx(kv / 4 / 2e9, rel=0.01)


def test_a_small_matrix_streams_at_the_rate_measured_for_its_size():
    """A decode's products on small matrices stream slower than calibrate's large ones (the call,
    the second thread's wake, the prefetchers' start, paid per matrix): each matrix at its size's
    factor of the large matrices' rate."""
    hw = gemm_only_profile(rate=BIG, memory_bandwidth=1e9, stream_size_factor={"1": [[1024.0, 0.5], [1 << 20, 1.0]]})
    assert hw.size_factor(1, 1024) == 0.5 and hw.size_factor(1, 1 << 22) == 1.0
    assert hw.size_factor(1, 32 * 1024) == pytest.approx(0.75)  # halfway in log(bytes)
    assert gemm_only_profile().size_factor(1, 10) == 1.0  # a profile without it: every size alike
    work = Workload(batch=1, prompt_len=1, gen_len=2)
    p = predict(SMALL, Layout(), work, hw)
    # SMALL's matrices are 4-32 KiB: q/k/v (64 x 128) and o (64 x 64) 32 and 16 KiB, gate/up and down 64 and 32 KiB
    sizes = [64 * 128 * 4, 64 * 64 * 4, 2 * 64 * 128 * 4, 64 * 128 * 4]
    per_layer = sum(n / (1e9 * hw.size_factor(1, n)) for n in sizes)
    head = 100 * 64 * 4 / (1e9 * hw.size_factor(1, 100 * 64 * 4))
    assert p.decode["gemm"] == pytest.approx(SMALL.layers * per_layer + head)


def test_decode_streams_each_matrix_at_the_rate_for_its_row_length():
    """A decode step's products are bound by how fast the weights stream, and the native kernel's
    speed depends on the row length (short rows stream faster than long ones; calibrate measures the
    curve, docs/benchmarks.md, "Choosing the layout"): q/k/v, gate/up and the LM head read rows of `hidden`, o_proj of the rank's heads x
    head_dim, down_proj of its share of the intermediate size."""
    rates = {"1": [[64, 4e9], [128, 1e9]]}  # interpolated in log(row length) between the points
    hw = gemm_only_profile(rate=BIG, memory_bandwidth=rates)
    work = Workload(batch=1, prompt_len=1, gen_len=2)
    p = predict(SMALL, Layout(), work, hw)
    per_layer = (
        64 * 16 * (4 + 2 * 2) * 4 / 4e9  # q, k, v: rows of hidden = 64
        + 64 * 4 * 16 * 4 / 4e9  # o_proj: rows of 4 heads x 16 = 64
        + 2 * 64 * 128 * 4 / 4e9  # gate, up: rows of 64
        + 128 * 64 * 4 / 1e9
    )  # down_proj: rows of 128
    head = 100 * 64 * 4 / 4e9
    assert p.decode["gemm"] == pytest.approx(SMALL.layers * per_layer + head)
    # tp=2: down_proj's rows are 64 long, o_proj's 32 (flat below the first point)
    two = predict(SMALL, Layout(tp=2), work, hw)
    per_layer2 = (64 * 16 * (2 + 2 * 1) + 2 * 16 * 64 + 2 * 64 * 64 + 64 * 64) * 4 / 4e9
    assert two.decode["gemm"] == pytest.approx(SMALL.layers * per_layer2 + 50 * 64 * 4 / 4e9)
    assert hw.bandwidth(1, 64 * 2**0.5) == pytest.approx(2.5e9)  # halfway in log(row length)
    assert hw.bandwidth(1) == 1e9  # no row length: the widest rows' rate


def test_prefill_attention_at_the_rate_for_its_head_size():
    """calibrate times attention per head size (a head of 32 has half the arithmetic per byte of one
    of 64, and runs at a lower rate); the model picks its own."""
    rates = {"1": {"16": [[1, 1e9]], "64": [[1, 4e9]]}}
    hw = gemm_only_profile(rate=BIG, attention_flops={"fp32": rates})
    assert hw.attention_rate("fp32", 1, 100, head_dim=32) == pytest.approx(2.5e9)  # halfway in log(head size)
    work = Workload(batch=1, prompt_len=100, gen_len=1)
    p = predict(SMALL, Layout(), work, hw)  # SMALL: heads of 16
    flops = causal_attention_flops(4, 16, 100)
    assert p.prefill["attention"] == pytest.approx(SMALL.layers * flops / 1e9)


# -- against Meta's published context-parallel prefill (arXiv 2411.01783) -------------------------
META_CASES = [  # layout, prompt tokens, measured seconds (the paper's tables and text)
    (Layout(tp=8), 131072, 42.01),
    (Layout(tp=8, cp=2), 131072, 21.04),
    (Layout(tp=8, cp=4), 131072, 10.95),
    (Layout(tp=8, cp=16), 1_000_000, 77.0),
]


@pytest.mark.parametrize("layout,tokens,measured", META_CASES, ids=lambda v: str(v))
def test_meta_llama3_405b_prefill_from_hardware_figures(layout, tokens, measured):
    """The built-in profile of Meta's hosts (published figures only, nothing fitted to these
    results) predicts these cases within 15% (docs/benchmarks.md has all of them, misses too)."""
    hw = load_profile("h100-meta-gtt")
    work = Workload(
        1, tokens, 1, weight_dtype="bf16", mlp_dtype="fp8", act_dtype="bf16", attention_dtype="bf16", kv_dtype="bf16"
    )
    p = predict(LLAMA3_405B, layout, work, hw, Schedule(overlap="off", ranks_per_node=8))
    assert abs(p.ttft_s / measured - 1) < 0.15, (p.ttft_s, measured, p.prefill)
    assert p.fits
    if tokens > 500_000:
        assert p.dominant_prefill == "attention"


def test_meta_ranking_context_parallel_before_multi_host_tensor_parallel():
    """Where Meta compared them (their table 7), CP over hosts beat TP across hosts: so does the plan."""
    hw = load_profile("h100-meta-gtt")
    work = Workload(
        1, 131072, 1, weight_dtype="bf16", mlp_dtype="fp8", act_dtype="bf16", attention_dtype="bf16", kv_dtype="bf16"
    )
    sched = Schedule(overlap="off", ranks_per_node=8)
    for cp_layout, tp_layout in ((Layout(tp=8, cp=2), Layout(tp=16)), (Layout(tp=8, cp=4), Layout(tp=32))):
        assert (
            predict(LLAMA3_405B, cp_layout, work, hw, sched).ttft_s
            < predict(LLAMA3_405B, tp_layout, work, hw, sched).ttft_s
        )

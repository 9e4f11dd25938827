"""Every tensor of a step on the model's device, checked here with fake CUDA tensors.

No GPU runs these tests: the model's weights and KV cache are fake CUDA tensors (support/
fake_devices.py), the ranks of a layout take turns on one fake world (support/fake_world.py), and
the engine's real step path runs over them: prefill chunks (prompts of different lengths, so
mixed steps attend in parts), decodes, a preemption (a cache too small for every request), and
a migration's KV block gather and scatter. Any op mixing a CPU tensor with a CUDA one raises (a
device mismatch, or a CPU index into a device tensor: a hidden copy and sync), and so does
anything that needs a device tensor's values on the host, which fake tensors do not have. Two
places need them by design and are handled at named seams:

- sampling: the engine's `sampler` runs the real sampler on the fake logits (its placement is
  checked) and then gives every row a fixed token, the values the host needs;
- the MoE layer's routing counts (the all-to-all's split sizes): a step of an MoE family stops
  at that one read, in its first sparse layer, and the rest of the layer (dispatch, experts,
  combine, gather) is checked on its own with given counts.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from loguru import logger
from torch._subclasses.fake_tensor import DataDependentOutputException

from dist_infer.engine.device_io import to_device, to_host
from dist_infer.engine.engine_core import Engine, EngineConfig, WorkerOptions
from dist_infer.engine.kv_transfer import PeerInstance, TransferOp
from dist_infer.engine.pipeline import TAG_FORWARD
from dist_infer.engine.sampling import SampledTokens, SamplingParams, sample_rows, usable_logits
from dist_infer.kernels import kernels_if_cpu_fp32, load_cpu_kernels
from dist_infer.models.config import ModelConfig
from dist_infer.models.loader import build_stage
from dist_infer.parallel.moe.routing import token_chunk
from dist_infer.topology import Layout
from tests.support.fake_devices import FakeCudaMode, NeedsRealValues, load_fake_cuda_guard, on_fake_device
from tests.support.fake_world import FakeLink, fake_groups

_NO_FAKE_CUDA = load_fake_cuda_guard()  # None: fake CUDA tensors index and move like real ones here
pytestmark = pytest.mark.skipif(_NO_FAKE_CUDA is not None, reason=str(_NO_FAKE_CUDA))

FIXED_TOKEN = 5
_BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=128,
    eos_token_id=2,
    rope_theta=10000.0,
)
FAMILIES = {
    "llama-gqa": dict(model_type="llama"),
    "llama-tied-mqa": dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=1),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2-moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
    ),  # a dense layer first, then experts
    "qwen3-moe": dict(
        model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
}
# name -> (layout, worker options)
LAYOUTS = {
    "tp1": (Layout(), {}),
    "tp2": (Layout(tp=2), {}),
    "tp2-overlap": (Layout(tp=2), {"overlap": "on"}),  # token halves, interleaved (TokenSplit metadata)
    "tp2-seqpar": (Layout(tp=2), {"sequence_parallel": "on"}),
    "pp2": (Layout(pp=2), {}),
    "tp2pp2": (Layout(tp=2, pp=2), {}),
    "ep2": (Layout(ep=2), {}),
    "cp2": (Layout(cp=2), {"cp_variant": "pass-kv"}),
    "cp2-pass-q": (Layout(cp=2), {"cp_variant": "pass-q"}),
}
DENSE_CASES = [("llama-gqa", name) for name in LAYOUTS if name != "ep2"] + [
    ("llama-tied-mqa", name) for name in ("tp1", "tp2", "pp2")
]
MOE_CASES = [
    (family, name) for family in ("mixtral", "qwen2-moe", "qwen3-moe") for name in ("tp1", "tp2", "pp2", "ep2", "cp2")
]
PROMPTS = [[7, 8, 9, 10, 11, 12], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
# the first request also asks for top logprobs and bans EOS for a while: the sampler's other device paths
PARAMS = [SamplingParams(max_new_tokens=6, logprobs=2, min_tokens=3)] + [SamplingParams(max_new_tokens=6)] * 2


class FixedTokenSampler:
    """The engine's sampler seam: the real sampler on the fake logits (it must keep to their
    device and need no host value), then FIXED_TOKEN for every row: device tensors with known
    values, which the engine's own copy to the host brings back as real ones."""

    def __init__(self, mode: FakeCudaMode):
        self.mode = mode
        self.calls = 0

    def __call__(self, logits: torch.Tensor, rows, eos_ids) -> SampledTokens:
        self.calls += 1
        real = sample_rows(logits, rows, eos_ids)
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            got = getattr(real, name)
            assert got.device == logits.device, f"sampled {name} on {got.device}, the logits on {logits.device}"
        n, k = len(rows), max((r.logprobs for r in rows), default=0)
        values = (
            torch.full((n,), FIXED_TOKEN, dtype=torch.long),
            torch.zeros(n, dtype=torch.float64),
            torch.zeros(n, k, dtype=torch.long),
            torch.zeros(n, k, dtype=torch.float64),
        )
        return SampledTokens(*(self.mode.with_values(v, logits.device.type) for v in values))


class Problems:
    """What the engine logged at WARNING and above while a test ran (it catches a step's
    exceptions to fail requests alone), with the exceptions it logged."""

    def __init__(self):
        self.messages: list[str] = []
        self.exceptions: list[BaseException] = []

    def __call__(self, message) -> None:
        record = message.record
        self.messages.append(record["message"])
        if record["exception"] is not None and record["exception"].value is not None:
            self.exceptions.append(record["exception"].value)

    def raise_first(self) -> None:
        if self.exceptions:
            raise self.exceptions[0]
        assert not self.messages, self.messages


@pytest.fixture
def problems():
    seen = Problems()
    logger.enable("dist_infer")  # the library is quiet unless enabled
    sink = logger.add(seen, level="WARNING")
    yield seen
    logger.remove(sink)
    logger.disable("dist_infer")


def config(family: str) -> ModelConfig:
    return ModelConfig.from_hf({**_BASE, **FAMILIES[family]}, family)


def fake_instance(family: str, layout_name: str, mode: FakeCudaMode, num_blocks: int, budget: Optional[int]):
    """Every rank's engine of `family` over the layout, weights and KV cache fake CUDA tensors;
    the followers run when the world asks for them (their plans' channel has mail)."""
    layout, options = LAYOUTS[layout_name]
    world, groups = fake_groups(layout)
    engines = []
    for g in groups:
        stage = on_fake_device(build_stage(config(family), g, torch.float32), mode)  # native CPU kernels on: unused
        with mode:
            settings = EngineConfig(
                block_size=4, num_blocks=num_blocks, max_batched_tokens=budget, worker=WorkerOptions(**options)
            )
            engines.append(Engine(stage, g, settings, sampler=FixedTokenSampler(mode)))
    for rank, engine in enumerate(engines[1:], 1):
        channel = ("bcast", engine.stage_comm.name) if engine.pp.rank == 0 else ("p2p", "pp", TAG_FORWARD)
        world.pumps[rank] = lambda e=engine, r=rank, c=channel: world.waiting(r, c) and (e.follow_one() or True)
    return world, engines


def run_followers(world, engines) -> None:
    while any(world.pumps[r]() for r in range(1, len(engines))):
        pass


def migrate_blocks(engines, world, link: FakeLink, request) -> None:
    """Every rank sends one block of `request` to another instance (of tp=1: a tp=2 one splits
    its heads anew) and receives one into a free block: the gather and the scatter of
    kv_transfer.py on the fake cache, the followers telling the driver their share is in; then
    the receive is committed."""
    addresses = [("127.0.0.1", 7000 + r) for r in range(len(engines))]
    for e in engines:
        e.enable_migration(link, addresses)
    driver = engines[0]
    pp = driver.pp.size
    peer = PeerInstance(1, 1, pp, tuple(("127.0.0.2", 8000 + r) for r in range(pp)))
    free = driver.scheduler.allocator.allocate()
    driver.queue_transfer(TransferOp(TransferOp.SEND, 1, 0, peer, list(request.block_table[:1])))
    driver.queue_transfer(TransferOp(TransferOp.RECV, 2, 0, peer, [free]))
    driver.step()
    run_followers(world, engines)
    driver.queue_transfer(TransferOp(TransferOp.COMMIT, 2))
    driver.step()
    run_followers(world, engines)
    driver.scheduler.allocator.free([free])
    for e in engines:
        assert not e.mover.failures and not e.mover.busy, f"rank {e.groups.world.rank}: transfers failed or hang"
    sent = {key[0] for key, _ in link.sent}
    assert 1 in sent, "no KV block was gathered and sent"
    assert 2 in sent or len(engines) == 1, "no follower said its share of the receive is in"
    assert link.received, "no KV receive was scattered"


def serve_until_done(family: str, layout_name: str, problems: Problems, migrate: bool):
    """Three requests through the fake instance until they finish: prefill chunks, decodes,
    at least one preemption (7 blocks of 4 tokens for three requests growing to 12+ tokens). cp
    ranks hold about half of each sequence, so 4 blocks there, and prefill whole prompts: all
    three in the first step, no token budget."""
    mode = FakeCudaMode()
    cp = LAYOUTS[layout_name][0].cp > 1
    world, engines = fake_instance(family, layout_name, mode, num_blocks=4 if cp else 7, budget=None if cp else 8)
    driver = engines[0]
    link = FakeLink()
    with mode:
        requests = [driver.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(zip(PROMPTS, PARAMS))]
        for _ in range(60):
            driver.step()
            run_followers(world, engines)
            problems.raise_first()
            if migrate and driver.mover is None and any(r.output_token_ids for r in requests):
                live = next(r for r in requests if r.block_table and not r.finished)
                migrate_blocks(engines, world, link, live)
                problems.raise_first()
            if not driver.has_unfinished():
                break
    return driver, requests, engines


@pytest.mark.parametrize("family,layout", DENSE_CASES)
def test_dense_steps_keep_every_tensor_on_the_device(family, layout, problems):
    migrate = not layout.startswith("cp")  # live migration of context-parallel instances is not supported
    driver, requests, engines = serve_until_done(family, layout, problems, migrate)
    problems.raise_first()
    assert all(r.finish_reason == "length" and r.output_token_ids == [FIXED_TOKEN] * 6 for r in requests)
    assert driver.scheduler.num_preemptions >= 1
    assert driver.step_driver.completed_steps > 3
    samplers = [e.sampler for e in engines if e.is_sampler]
    assert (
        len(samplers) == 1 and samplers[0].calls >= driver.step_driver.completed_steps
    )  # the real sampler ran every step


@pytest.mark.parametrize("family,layout", MOE_CASES)
def test_moe_steps_reach_the_routing_counts_on_the_device(family, layout, problems):
    """An MoE step runs on the device up to its first sparse layer's routing counts, whose host
    read is the all-to-all's split sizes: the one value fake tensors cannot give."""
    with pytest.raises((NeedsRealValues, DataDependentOutputException)) as stop:
        serve_until_done(family, layout, problems, migrate=False)
        problems.raise_first()
    frames = [f.name for f in stop.traceback]
    assert "routing_counts" in frames, frames


@pytest.mark.parametrize(
    "family,tp,ep", [("mixtral", 1, 2), ("qwen2-moe", 2, 1), ("qwen2-moe", 1, 2), ("qwen3-moe", 2, 2)]
)
def test_moe_layer_after_its_routing_counts_stays_on_the_device(family, tp, ep):
    """The rest of a sparse layer (dispatch, this rank's experts, combine, shared expert, the ep
    gather) with routing counts given on the host, as the all-gather of real ones would."""
    mode = FakeCudaMode()
    _, groups = fake_groups(Layout(tp=tp, ep=ep))
    g = groups[-1]  # the last rank: every ep rank but the first sends it rows
    stage = on_fake_device(build_stage(config(family), g, torch.float32), mode)
    moe = next(layer.mlp for layer in stage.layers if layer.sparse)
    with mode, torch.inference_mode():
        x = torch.empty(5, _BASE["hidden_size"], device="cuda")
        routing = moe.route(x)
        assert {t.device.type for t in (routing.tokens, routing.weights, routing.counts)} == {"cuda"}
        mine = moe.placement.local_experts(g.ep.rank)
        counts = [[0] * moe.num_experts for _ in range(ep)]
        for r in range(ep):  # every rank's pairs to one of this rank's experts, this rank's own to another
            counts[r][mine[0] if r == g.ep.rank else mine[-1]] = token_chunk(5, ep, r)[1] * moe.top_k
        y = moe.exchange(x, routing, counts)
        out = moe.gather_chunks(y, x.shape[0])
    assert y.device.type == out.device.type == "cuda" and out.shape == x.shape


def test_host_crossings_pin_only_for_cuda():
    """The engine's two crossings: a host tensor to CUDA through pinned memory, a CUDA tensor's
    values to a pinned host buffer (here the values do not exist: the copy is where a run stops);
    on the CPU neither copies nor pins."""
    mode = FakeCudaMode()
    host = torch.arange(4)
    with mode:
        moved = to_device(host, torch.device("cuda"))
        assert moved.device.type == "cuda" and mode.pinned == 1
        with pytest.raises(NeedsRealValues):
            to_host(moved)
        assert mode.pinned == 2
        assert to_device(host, torch.device("cpu")) is host and to_host(host) is host
    assert mode.pinned == 2


def test_the_device_path_of_usable_logits_gives_the_host_paths_values():
    """Dead rows (all NaN, all banned) replaced without a host read: the same values as with one."""
    logits = torch.tensor([[1.0, float("nan"), 3.0], [float("nan")] * 3, [0.5, 2.0, -1.0], [4.0, 5.0, 6.0]])
    banned = torch.tensor([[False, False, True], [False, True, False], [True, True, True], [False, False, False]])
    torch.testing.assert_close(
        usable_logits(logits, banned, read_host=False), usable_logits(logits, banned, read_host=True)
    )


def test_the_native_cpu_kernels_serve_host_tensors_only():
    """Their dispatch guard looks at the device type, so no device tensor (CUDA, or any other)
    reaches a kernel that reads host memory; the stages above ran with them loaded."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler for the native CPU kernels")
    mode = FakeCudaMode()
    host = torch.zeros(2, 4)
    with mode:
        on_cuda = torch.zeros(2, 4, device="cuda")
        assert kernels_if_cpu_fp32(kernels, on_cuda) is None and kernels_if_cpu_fp32(kernels, host, on_cuda) is None
    assert kernels_if_cpu_fp32(kernels, torch.zeros(2, 4, device="meta")) is None
    assert kernels_if_cpu_fp32(kernels, host) is kernels

"""Bucketed decode steps (engine/decode_graphs.py, engine/device_io.py DecodeInputs) on the CPU.

Without a GPU nothing is captured, but everything a captured step reads is here: the buckets, the
persistent buffers filled by one copy, the padding rows that write to the scratch slot. The
'padded' mode runs those steps eagerly; it must give exactly the plain steps' ids (greedy and
seeded sampling), with the native CPU kernels and with the Triton kernels in their interpreter
(against transformers too), and a step through the buffers reads nothing back to the host.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest
import torch

import dist_infer
from dist_infer.engine.decode_graphs import GraphCaptureError, graph_buckets, graphs_wanted
from dist_infer.engine.device_io import DecodeInputs
from dist_infer.engine.engine_core import Engine, EngineConfig, WorkerOptions
from dist_infer.engine.sampling import SamplingParams
from dist_infer.kernels import use_native_kernels
from dist_infer.kernels.gpu import triton_interpreting
from tests.support.checkpoints import write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf, prompts_for


def test_buckets_and_modes():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 8]
    assert graph_buckets(256)[-1] == 256 and len(graph_buckets(256)) == 9
    cpu = torch.device("cpu")
    assert graphs_wanted("padded", cpu) and not graphs_wanted("auto", cpu) and not graphs_wanted("off", cpu)
    with pytest.raises(GraphCaptureError, match="needs a CUDA stage"):
        graphs_wanted("on", cpu)
    with pytest.raises(ValueError, match="one of auto, on, off"):
        graphs_wanted("sometimes", cpu)


def test_decode_inputs_fill_the_rows_and_pad_the_rest():
    inputs = DecodeInputs(rows=4, width=3, scratch_slot=8 * 16, block_size=16, device=torch.device("cpu"))
    inputs.fill([11, 12], [0, 37], [[5], [2, 7, 1]])
    assert inputs.ids.tolist() == [11, 12, 0, 0]
    assert inputs.positions.tolist() == [0, 37, 0, 0]
    assert inputs.slots.tolist() == [5 * 16, 1 * 16 + 5, 128, 128]  # position 37: block 2 of its table, offset 5
    assert inputs.seq_lens.tolist() == [1, 38, 1, 1]
    assert inputs.block_tables[1].tolist() == [2, 7, 1] and inputs.block_tables[2:, 0].tolist() == [8, 8]
    inputs.fill([3], [4], [[6]])  # a smaller step: the rows it leaves are padding again
    assert inputs.ids.tolist() == [3, 0, 0, 0] and inputs.slots.tolist() == [100, 128, 128, 128]
    with pytest.raises(ValueError, match="does not fit the 4 rows"):
        inputs.fill([1] * 5, [0] * 5, [[0]] * 5)
    with pytest.raises(ValueError, match="wider than the 3"):
        inputs.fill([1], [0], [[0, 1, 2, 3]])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    return {arch: write_hf_checkpoint(root, arch, subdir=arch) for arch in ("llama-gqa", "mistral")}


@pytest.fixture(scope="module")
def world(checkpoints):
    with dist_infer.load(checkpoints["llama-gqa"]) as model:  # joins a world of one, closed after the module
        yield model.engine.groups


def _ids(stage, groups, prompts, mode: str, params: SamplingParams):
    engine = Engine(stage, groups, EngineConfig(block_size=16, worker=WorkerOptions(cuda_graphs=mode)))
    outs = engine.generate(prompts, params)
    assert (engine.worker.graphs is not None) == (mode == "padded")
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("lengths", [[9], [5, 17, 33], [3, 5, 8, 13, 21]])
def test_padded_steps_give_the_plain_steps_ids(checkpoints, world, lengths):
    """Batches of 1, 3 (bucket 4) and 5 (bucket 8), native CPU kernels, greedy and seeded sampling."""
    stage = dist_infer.load(checkpoints["llama-gqa"], groups=world).engine.stage
    prompts = prompts_for(lengths)
    for params in (SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.9, seed=7)):
        assert _ids(stage, world, prompts, "padded", params) == _ids(stage, world, prompts, "off", params)


@pytest.mark.parametrize("arch", ["llama-gqa", "mistral"])  # mistral: a sliding window
def test_padded_steps_on_the_triton_kernels_give_hfs_ids(checkpoints, world, arch):
    """The GPU's decode path (Triton kernels, bucketed buffers) in Triton's interpreter."""
    from dist_infer.kernels.gpu import load_gpu_kernels, use_gpu_kernels

    pytest.importorskip("triton", reason="Triton is not installed (the dev extra installs it)")
    if not triton_interpreting():
        pytest.skip("the Triton kernels take CPU tensors in Triton's interpreter only (tests/conftest.py)")
    stage = dist_infer.load(checkpoints[arch], groups=world).engine.stage
    use_native_kernels(stage, None)
    use_gpu_kernels(stage, load_gpu_kernels())
    prompts = prompts_for([5, 17, 33])
    got = _ids(stage, world, prompts, "padded", SamplingParams(max_new_tokens=6))
    assert_ids_match_hf(checkpoints[arch], prompts, got, 6, f"{arch}: Triton kernels, padded buckets")


HOST_READS = [(torch.Tensor, name) for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")]


@contextmanager
def host_reads_forbidden():
    """Every read of a tensor's values by the host raises, except inside Triton's interpreter (which
    runs the kernels on the host by design); torch.cuda.synchronize raises too."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in HOST_READS]

    def guard(name, original):
        def call(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith("triton"):
                raise AssertionError(f"host read inside the decode step: Tensor.{name} from {caller}")
            return original(*args, **kwargs)

        return call

    for owner, name, original in saved:
        setattr(owner, name, guard(name, original))
    sync = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: (_ for _ in ()).throw(AssertionError("torch.cuda.synchronize in the step"))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        torch.cuda.synchronize = sync


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_bucketed_step_reads_nothing_back(checkpoints, world, kernels):
    """The step a graph would capture, run with host reads forbidden: torch's ops, and the Triton kernels."""
    from dist_infer.kernels.gpu import load_gpu_kernels, use_gpu_kernels

    stage = dist_infer.load(checkpoints["mistral"], groups=world).engine.stage
    use_native_kernels(stage, None)
    if kernels == "triton":
        pytest.importorskip("triton")
        if not triton_interpreting():
            pytest.skip("the Triton kernels take CPU tensors in Triton's interpreter only (tests/conftest.py)")
        use_gpu_kernels(stage, load_gpu_kernels())
    engine = Engine(
        stage,
        world,
        EngineConfig(block_size=16, num_blocks=16, max_num_seqs=4, worker=WorkerOptions(cuda_graphs="padded")),
    )
    graphs = engine.worker.graphs
    step = graphs.prepare([5, 6, 7], [40, 9, 70], [[0, 1, 2], [3], [4, 5, 6, 7, 8]])
    assert step.bucket == 4 and step.rows == 3
    with host_reads_forbidden():
        out = graphs.run(step)
    assert out.shape == (3, stage.cfg.vocab_size) and torch.isfinite(out).all()

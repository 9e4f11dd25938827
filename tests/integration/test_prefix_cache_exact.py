"""Automatic prefix caching across real processes: tp=2, pp=2 and MoE ep=2 under torchrun.

Each case runs one job that generates prompts sharing a prefix four times (caching on and off,
a roomy cache and one too small for everyone, so requests are preempted and recomputed) with a
token budget that makes the later prompts start while the earlier ones' blocks are cached, and
checks every run against HF's fp32 greedy decoding (ids identical up to a near tie, logits within
1e-4) and the runs against each other (ids identical, logits within 1e-4), and that caching on
found cached tokens and caching off none.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from dist_infer.topology import free_port
from tests.support.hf_compare import ATOL, RTOL, CheckpointStore, assert_matches_hf, prompts_for
from tests.support.processes import run

JOB_TIMEOUT = 120  # a case takes about 10 s here; this only bounds a hang
NEW_TOKENS = 5
ROOMY, TIGHT = 64, 7  # blocks of 4 tokens: the longest request needs 6

JOB = textwrap.dedent('''
    """Generate the prompts with prefix caching on and off, in a roomy and a tight cache; rank 0 saves it all."""
    import json, sys
    import torch
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.launch.rank import join_job
    from dist_infer.models.loader import load_stage
    from dist_infer.topology import Layout

    model, layout, prompts_file, out_file, new, roomy, tight = sys.argv[1:8]
    prompts = json.loads(open(prompts_file).read())
    groups = join_job("gloo", Layout(**json.loads(layout)), 60, log_level="WARNING")
    stage, _ = load_stage(model, groups, torch.float32)
    results = {}
    for caching in (True, False):
        for blocks in (int(roomy), int(tight)):
            engine = Engine(stage, groups, EngineConfig(block_size=4, num_blocks=blocks, max_batched_tokens=6,
                                                        max_num_seqs=3, prefix_caching=caching))
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=int(new), stop_at_eos=False),
                                   return_logits=True)
            if groups.world.rank == 0:
                results[f"{caching}-{blocks}"] = {
                    "ids": [o.token_ids for o in outs], "logprobs": [o.logprobs for o in outs],
                    "logits": [torch.stack(o.logits) for o in outs], "stats": engine.stats(),
                    "preemptions": engine.scheduler.num_preemptions}
            engine.close()
    if groups.world.rank == 0:
        torch.save(results, out_file)
    world = groups.world
    groups.destroy()
    world.destroy()
''')

CASES = {"tp2": ("llama-gqa", {"tp": 2}), "pp2": ("llama-gqa", {"pp": 2}), "moe-ep2": ("mixtral", {"ep": 2})}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("prefix"), NEW_TOKENS)


def _prompts() -> list[list[int]]:
    """An 11-token prefix shared by most prompts (one asked twice, one the bare prefix), one apart."""
    prefix, tails = prompts_for([11], seed=7)[0], prompts_for([1, 5, 3, 9], seed=8)
    return [prefix + tails[1], prefix + tails[0], prefix + tails[2], prefix + tails[1], prefix, tails[3]]


@pytest.mark.parametrize("case", list(CASES))
def test_prefix_caching_on_and_off_match_hf_and_each_other(case, store, tmp_path):
    arch, layout = CASES[case]
    model = store.model(arch)
    prompts = _prompts()
    ref_ids, ref_logits = store.reference(model, prompts)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "results.pt"
    world = 1
    for v in layout.values():
        world *= v
    cmd = [
        "torchrun",
        "--nproc-per-node",
        str(world),
        "--master-port",
        str(free_port()),
        str(tmp_path / "job.py"),
        str(model),
        json.dumps(layout),
        str(tmp_path / "prompts.json"),
        str(out),
        str(NEW_TOKENS),
        str(ROOMY),
        str(TIGHT),
    ]
    result = run(cmd, JOB_TIMEOUT)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    runs = torch.load(out)
    for name, got in runs.items():
        rows = [
            {"prompt_token_ids": p, "token_ids": ids, "logprobs": lp}
            for p, ids, lp in zip(prompts, got["ids"], got["logprobs"])
        ]
        assert_matches_hf({"outputs": rows}, got["logits"], prompts, ref_ids, ref_logits, f"{case} {name}")
        stats = got["stats"]
        caching, blocks = name.split("-")
        print(
            f"{case} caching {caching}, {blocks} blocks: {stats['prefix_cache_hits']} of "
            f"{stats['prefix_cache_queries']} tokens cached, {got['preemptions']} preemptions"
        )
        assert stats["free_blocks"] == int(blocks), f"{case} {name}: idle, every block allocatable"
        if caching == "True":
            assert stats["prefix_cache_hits"] >= 16, f"{case} {name}: later prompts start from the cached prefix"
        else:
            assert stats["prefix_cache_hits"] == stats["prefix_cache_queries"] == 0
        if int(blocks) == TIGHT:
            assert got["preemptions"] > 0, f"{case} {name}: the tight cache was meant to preempt"
    for blocks in (ROOMY, TIGHT):
        on, off = runs[f"True-{blocks}"], runs[f"False-{blocks}"]
        assert on["ids"] == off["ids"], f"{case}, {blocks} blocks: caching changed the tokens"
        for a, b in zip(on["logits"], off["logits"]):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)

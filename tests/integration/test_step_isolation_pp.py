"""A request can fail only itself, with pp=2 in real processes under the launcher: the
sampler rank (the last stage) is not the driver, and the failed row's error id travels back to it.
(One rank and tp=2 on threads: tests/unit/engine/test_step_isolation.py.)"""

from __future__ import annotations

import re
import sys
import textwrap

from tests.support.checkpoints import write_hf_checkpoint
from tests.support.paths import REPO
from tests.support.processes import last_json, run

NEW = 6
BLOCKS = 32
MARKER = 424242  # the seed of the request whose sampling raises
BOOM = "probability tensor contains either inf, nan or element < 0"


PP_JOB = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    from loguru import logger
    import dist_infer.engine.stage_runner as stage_runner
    import dist_infer.engine.engine_core as engine_core
    from dist_infer.comm import build_groups, init_world
    from dist_infer.engine.sampling import SamplingParams, sample_rows
    from dist_infer.models.loader import load_stage
    from dist_infer.topology import Mesh, Layout
    from tests.support.hf_compare import prompts_for

    def exploding(logits, rows, eos_ids=()):  # on the sampler rank: the last stage, not the driver
        if any(r.seed == {marker} and r.index >= 1 for r in rows):
            raise RuntimeError({boom!r})
        return sample_rows(logits, rows, eos_ids)

    stage_runner.sample_rows = exploding  # the sampler rank samples in its share of the step
    logger.enable("dist_infer")  # a library is quiet unless asked
    world = init_world("auto")
    groups = build_groups(world, Mesh.build(Layout(pp=2), world.size))
    engine = engine_core.Engine(load_stage(sys.argv[1], groups)[0], groups,
                                engine_core.EngineConfig(block_size=4, num_blocks={blocks}))
    if not engine.is_driver:
        engine.follow()
        sys.exit(0)
    prompts = prompts_for([5, 9, 7, 4], seed=30)

    def serve(reqs):
        got = {{rid: dict(tokens=[], reason=None, error=None) for rid in reqs}}
        for rid, (i, seed) in reqs.items():
            engine.add_request(rid, prompts[i], SamplingParams(max_new_tokens={new}, stop_at_eos=False, seed=seed))
        while engine.has_unfinished():
            for out in engine.step():
                g = got[out.request_id]
                g["tokens"] += out.new_token_ids
                if out.finished:
                    g["reason"], g["error"] = out.finish_reason, out.error
        return got

    alone = [serve({{"alone": (i, 0)}})["alone"]["tokens"] for i in range(4)]
    batch = serve({{"a": (0, 0), "bad": (1, {marker}), "c": (2, 0)}})
    later = serve({{"d": (3, 0)}})
    free = engine.scheduler.allocator.num_free
    engine.stop_followers()
    print(json.dumps(dict(alone=alone, batch=batch, later=later, free=free)))
""")


def test_pp2_processes_a_failure_on_the_last_stages_sampler_fails_alone(tmp_path):
    """pp=2 through the launcher: the sampler rank is not the driver; the failed row travels back."""
    path = write_hf_checkpoint(tmp_path / "ckpt", "llama-gqa")
    script = tmp_path / "pp_job.py"
    script.write_text(PP_JOB.format(repo=str(REPO), marker=MARKER, boom=BOOM, blocks=BLOCKS, new=NEW))
    result = run(["dist-infer", "launch", "--nproc-per-node", "2", "--", sys.executable, str(script), str(path)], 240)
    assert result.returncode == 0
    got = last_json(result.stdout)
    alone, batch = got["alone"], got["batch"]
    error = batch["bad"]["error"]
    assert batch["bad"]["reason"] == "abort" and "request bad failed in sampling" in error
    assert BOOM not in error and "RuntimeError" not in error and batch["bad"]["tokens"] == alone[1][:1]
    assert [batch["a"]["tokens"], batch["c"]["tokens"], got["later"]["d"]["tokens"]] == [alone[0], alone[2], alone[3]]
    assert batch["a"]["error"] is None and batch["a"]["reason"] == "length"
    assert got["free"] == BLOCKS, "KV blocks conserved"
    error_id = re.search(r"err-[0-9a-f]{12}", error).group(0)
    assert re.search(rf"{error_id}\): RuntimeError: {re.escape(BOOM)}", result.stderr), (
        "the sampler rank logs why, under the id the driver's client got"
    )

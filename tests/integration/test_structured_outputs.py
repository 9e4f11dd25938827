"""Structured outputs in real multi-rank jobs under our launcher: tp=2 (the driver samples), pp=2
(the last stage samples, so every grammar mask crosses the pipeline in the step plan), cp=2 (ring
attention, whole prompts) and ep=2 (a Mixtral's experts split) give exactly the single-process
constrained output, greedy and seeded, beside an unconstrained request, with the prompts chunked
where the layout chunks them; and `dist-infer generate --json-schema` on tp=2. (One rank, tp=2 on
threads, preemption, resumption: tests/unit/engine/structured/.)"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from tests.support.paths import REPO
from tests.support.processes import last_json, one_torch_thread, run  # noqa: F401 (a fixture)
from tests.support.structured_checkpoints import write_structured_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = [[0, 17, 90, 301, 44], [0, 250, 12], [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]

JOB = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    from dist_infer.comm import build_groups, init_world
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.engine.structured.spec import StructuredSpec
    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.models.loader import load_stage
    from dist_infer.topology import Mesh
    from dist_infer.topology.layout import parse_layout

    path, layout = sys.argv[1], parse_layout(sys.argv[2])
    world = init_world("auto")
    groups = build_groups(world, Mesh.build(layout, world.size))
    config = EngineConfig(block_size=4, num_blocks=128, max_batched_tokens=6)
    engine = Engine(load_stage(path, groups)[0], groups, config, tokenizer=lambda: TextTokenizer(path))
    if not engine.is_driver:
        engine.follow()
        sys.exit(0)
    spec = StructuredSpec.from_kind("json_schema", json.loads(sys.argv[3]))
    params = [
        SamplingParams(max_new_tokens=120, structured=spec),
        SamplingParams(max_new_tokens=120, temperature=1.0, seed=5, structured=spec),
        SamplingParams(max_new_tokens=10),
    ]
    prompts = json.loads(sys.argv[4])
    requests = [engine.add_request(f"r{{i}}", p, s) for i, (p, s) in enumerate(zip(prompts, params))]
    while engine.has_unfinished():
        engine.step()
    engine.stop_followers()
    print(json.dumps(dict(ids=[r.output_token_ids for r in requests], reasons=[r.finish_reason for r in requests])))
""")


def single_process(path) -> dict:
    """The same requests on one rank in this process: the reference."""
    from dist_infer.engine.engine_core import Engine, EngineConfig
    from dist_infer.engine.sampling import SamplingParams
    from dist_infer.engine.structured.spec import StructuredSpec
    from dist_infer.engine.tokenizer import TextTokenizer
    from dist_infer.models.loader import load_stage
    from tests.support.threads import thread_groups

    (groups,) = thread_groups(1, 1)
    engine = Engine(
        load_stage(path, groups)[0],
        groups,
        EngineConfig(block_size=4, num_blocks=128),
        tokenizer=lambda: TextTokenizer(path),
    )
    spec = StructuredSpec.from_kind("json_schema", SCHEMA)
    params = [
        SamplingParams(max_new_tokens=120, structured=spec),
        SamplingParams(max_new_tokens=120, temperature=1.0, seed=5, structured=spec),
        SamplingParams(max_new_tokens=10),
    ]
    requests = [engine.add_request(f"r{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, params))]
    while engine.has_unfinished():
        engine.step()
    engine.stop_followers()
    return dict(ids=[r.output_token_ids for r in requests], reasons=[r.finish_reason for r in requests])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (its checkpoint, the single-process outputs), each made once."""
    made: dict = {}

    def get(arch: str):
        if arch not in made:
            path = write_structured_checkpoint(tmp_path_factory.mktemp("ckpt"), arch)
            made[arch] = (path, single_process(path))
        return made[arch]

    return get


@pytest.mark.parametrize(
    "arch,layout", [("llama-gqa", "tp=2"), ("llama-gqa", "pp=2"), ("llama-gqa", "cp=2"), ("mixtral", "ep=2")]
)
def test_a_two_rank_job_gives_the_single_process_constrained_output(checkpoints, tmp_path, arch, layout):
    import jsonschema

    from dist_infer.engine.tokenizer import TextTokenizer

    path, want = checkpoints(arch)
    assert want["reasons"] == ["stop", "stop", "length"], "both constrained outputs complete"
    tokenizer = TextTokenizer(path)
    for ids in want["ids"][:2]:
        jsonschema.validate(json.loads(tokenizer.decode([t for t in ids if t != 1])), SCHEMA)
    script = tmp_path / "structured_job.py"
    script.write_text(JOB.format(repo=str(REPO)))
    cmd = ["dist-infer", "launch", "--nproc-per-node", "2", "--", sys.executable, str(script), str(path), layout]
    result = run(cmd + [json.dumps(SCHEMA), json.dumps(PROMPTS)], 240)
    assert result.returncode == 0
    assert last_json(result.stdout) == want, layout


def test_dist_infer_generate_takes_a_json_schema(checkpoints):
    """The CLI's --json-schema on tp=2: the greedy request's ids, its text valid JSON of the schema."""
    import jsonschema

    path, want = checkpoints("llama-gqa")
    ids = ",".join(map(str, PROMPTS[0]))
    cmd = ["dist-infer", "generate", "--model", str(path), "--tp", "2", "--prompt-ids", ids]
    result = run(cmd + ["--max-new-tokens", "120", "--json-schema", json.dumps(SCHEMA), "--json"], 240)
    assert result.returncode == 0
    (out,) = last_json(result.stdout)["outputs"]
    assert out["token_ids"] == want["ids"][0] and out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_dist_infer_generate_refuses_a_bad_spec_on_every_rank_without_hanging(checkpoints, tmp_path):
    """A spec that is not JSON fails before any rank starts; one the model's vocabulary cannot take,
    or any spec on a checkpoint without tokenizer.json, fails on every rank of a tp=2 job alike."""
    import shutil

    path, _ = checkpoints("llama-gqa")
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(path, bare)
    (bare / "tokenizer.json").unlink()
    base = ["dist-infer", "generate", "--prompt-ids", "0,5,6", "--max-new-tokens", "4"]
    cases = [
        (["--model", str(path), "--json-schema", "{oops"], ["--json-schema: json_schema is not valid JSON"]),
        (["--model", str(path), "--tp", "2", "--regex", "a(b"], ["invalid regex", "unclosed group"]),
        (["--model", str(bare), "--tp", "2", "--json-object"], ["structured outputs need a tokenizer"]),
    ]
    for flags, needles in cases:
        result = run(base + flags, 120)
        assert result.returncode not in (0, None), flags
        for needle in needles:
            assert needle in result.stderr, (flags, needle, result.stderr[-3000:])
        assert "Traceback (most recent call last)" not in result.stderr, result.stderr[-3000:]

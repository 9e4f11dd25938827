"""Ladder Residual (--ladder-residual, config.json's ladder_residual) as real processes.

transformers has no ladder model, so the ground truth is tests/support/ladder_reference.py: plain
single-process torch over the HF checkpoint's weights, recomputing every prefix in full. Against it:

- `dist-infer generate --pp 2` under our launcher, every layer laddered and layers 1:2 (a range
  that crosses the stage boundary of the 4-layer model, so stage 1 receives a [T, 2H] hand-over:
  the residual and the pending attention output); greedy ids identical, every step's logits
  (--dump-logits) and log-probabilities within 1e-4;
- the same for `--tp 2` over mpirun with the MPI backend and no shared memory (the ladder's
  asynchronous all-reduce through MPI);
- `dist-infer serve --tp 2` of a checkpoint whose config.json asks for the ladder itself, a cache
  too small for the burst of concurrent greedy requests (forced preemption and recomputation):
  every request's ids identical to the reference's for its prompt alone;
- `dist-infer bench --compare ladder`: the same command run again as a ladder, beside ours.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch

from tests.support.checkpoints import load_hf_model, write_hf_checkpoint
from tests.support.hf_compare import assert_matches_hf, prompts_for
from tests.support.ladder_reference import reference_greedy
from tests.support.processes import checkout_env, one_torch_thread, run, venv_exe  # noqa: F401 (a fixture)
from tests.support.serving_helpers import ServerJob, complete_ids, run_async, stream_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW = 6
LAYERS = 4
TIMEOUT_S = 120  # a case takes a few seconds here; this only bounds a hang
PROMPTS = prompts_for([5, 11, 3], seed=31)
SERVED = prompts_for([15, 17, 14, 16, 4], seed=32)  # the burst of test_served_...: 4 long, one short
LADDERS = {"all": (0, LAYERS - 1), "1:2": (1, 2)}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("ladder-procs"), "llama-gqa", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def hf(model):
    return load_hf_model(model)


_refs: dict = {}


def _reference(hf, prompts, ladder):
    """(ids, logits) per prompt, each greedy alone; cached per module run (the reference costs a little)."""
    out = []
    for p in prompts:
        key = (tuple(p), ladder)
        if key not in _refs:
            _refs[key] = reference_greedy(hf, p, ladder, NEW)
        out.append(_refs[key])
    return [ids for ids, _ in out], [logits for _, logits in out]


def _generate(prefix: list[str], model, dump, flags: list[str]) -> dict:
    cmd = [
        *prefix,
        "generate",
        "--model",
        str(model),
        "--max-new-tokens",
        str(NEW),
        "--no-eos-stop",
        "--json",
        "--dump-logits",
        str(dump),
        *flags,
    ]
    for p in PROMPTS:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = run(cmd, TIMEOUT_S, env=checkout_env())
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"no stdout\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def _check(out: dict, dump, hf, ladder: str, what: str, tp: int, pp: int) -> None:
    par = out["parallel"]
    assert (par["tp"], par["pp"], par["world_size"]) == (tp, pp, tp * pp), par
    ref_ids, ref_logits = _reference(hf, PROMPTS, LADDERS[ladder])
    assert_matches_hf(out, torch.load(dump), PROMPTS, ref_ids, ref_logits, what)


@pytest.mark.parametrize("ladder", list(LADDERS))
def test_pp2_generate_matches_the_reference(model, hf, tmp_path, ladder):
    """Our launcher, 2 stages of 2 layers: the hand-over between them is [T, 2H] inside a ladder
    range that spans the boundary (both cases here), [T, H] outside one."""
    dump = tmp_path / "logits.pt"
    out = _generate([venv_exe("dist-infer")], model, dump, ["--pp", "2", "--nproc", "2", "--ladder-residual", ladder])
    _check(out, dump, hf, ladder, f"pp=2 --ladder-residual {ladder}", 1, 2)


def test_the_ladder_changes_the_greedy_ids(hf):
    """Else the cases here would pass on a job that ignored the ladder."""
    for prompts, ladders in ((PROMPTS, list(LADDERS)), (SERVED, ["all"])):
        plain = [reference_greedy(hf, p, None, NEW)[0] for p in prompts]
        for name in ladders:
            assert _reference(hf, prompts, LADDERS[name])[0] != plain, name


def test_tp2_generate_over_mpirun_matches_the_reference(model, hf, tmp_path):
    mpirun = shutil.which("mpirun") or venv_exe("mpirun")
    dump = tmp_path / "logits.pt"
    out = _generate(
        [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", venv_exe("dist-infer")],
        model,
        dump,
        ["--tp", "2", "--backend", "mpi", "--shm", "off", "--ladder-residual", "all"],
    )
    assert "mpi" in out["parallel"]["backend"], out["parallel"]
    _check(out, dump, hf, "all", "mpirun tp=2 --ladder-residual all", 2, 1)


def test_tp2_over_the_groups_own_links_matches_the_reference(model, hf, tmp_path):
    """--shm socket (what a tp group across hosts uses): each module's all-reduce is posted over the
    TCP links and read a module later, where its output joins the residual."""
    dump = tmp_path / "logits.pt"
    out = _generate(
        [venv_exe("dist-infer")],
        model,
        dump,
        ["--tp", "2", "--nproc", "2", "--shm", "socket", "--ladder-residual", "all"],
    )
    _check(out, dump, hf, "all", "tp=2 --shm socket --ladder-residual all", 2, 1)


async def _burst(url: str, prompts) -> list[list[int]]:
    """Every prompt at once (they compete for the blocks), half streamed; greedy, NEW tokens each."""
    async with httpx.AsyncClient() as client:
        calls = [
            (stream_ids if i % 2 else complete_ids)(client, url, p, max_tokens=NEW, temperature=0, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*calls)
    return [r["token_ids"] if "token_ids" in r else r["choices"][0]["token_ids"] for r in results]


def test_served_ladder_checkpoint_under_preemption_matches_the_reference(model, hf, tmp_path):
    """The checkpoint's own config.json says ladder_residual: true (no flag); 9 blocks of 4 tokens
    hold about one 14-17 token prompt and its 6 new tokens, so the burst of 4 must preempt."""
    served = tmp_path / "ladder-model"
    shutil.copytree(model, served)
    cfg = json.loads((served / "config.json").read_text())
    (served / "config.json").write_text(json.dumps({**cfg, "ladder_residual": True}))
    prompts = SERVED
    args = [
        "--model",
        served,
        "--nproc",
        "2",
        "--tp",
        "2",
        "--block-size",
        "4",
        "--max-batched-tokens",
        "7",
        "--kv-blocks",
        "9",
        "--max-num-seqs",
        "4",
        "--timeout",
        "60",
    ]
    with ServerJob(tmp_path, args, env=checkout_env()) as server:
        got = run_async(_burst(server.url, prompts))
        metrics = server.metrics()
        assert metrics["dist_infer:num_preemptions_total"] > 0, "the burst was meant to preempt"
        assert metrics["dist_infer:kv_cache_usage_perc"] == 0.0, "every block free again"
        assert server.stop() == 0, server.log()[-4000:]
    want, _ = _reference(hf, prompts, LADDERS["all"])
    for i, (ids, ref) in enumerate(zip(got, want)):
        assert ids == ref, f"served ladder, prompt {i} (len {len(prompts[i])}): {ids} vs the reference's {ref}"


def test_bench_compares_the_ladder_on_the_same_layout(model):
    """`bench --compare ladder`: the same command line run again with every layer laddered, as a
    peer beside ours (the standard wiring), its ratios in the JSON."""
    cmd = [
        venv_exe("dist-infer"),
        "bench",
        "--model",
        str(model),
        "--tp",
        "2",
        "--batch",
        "1",
        "--prompt-len",
        "8",
        "--gen-len",
        "3",
        "--compare",
        "ladder",
        "--json",
    ]
    proc = run(cmd, TIMEOUT_S, env=checkout_env())
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-4000:]}"
    ours = json.loads([ln for ln in proc.stdout.splitlines() if ln.strip()][-1])
    peer = ours["compare"]["ladder"]
    assert peer["ok"], peer.get("error")
    assert ours["ladder_layers"] is None and peer["ladder_layers"] == [0, LAYERS - 1], (ours, peer)
    assert (peer["tp"], peer["world_size"]) == (2, 2) and peer["decode_ratio"] > 0 and peer["prefill_ratio"] > 0

"""dist_infer under a real Slurm: a one-host slurmctld + slurmd on 127.0.0.1 (tests/support/slurm_cluster.py;
`make slurm` installs Debian's slurm-wlm and munge where it can, else these tests skip and say why).

- `srun -n 4 dist-infer generate --tp 2 --pp 2`: the ranks find themselves in the step's SLURM_*
  variables and meet on its first node; greedy ids identical to transformers', every step's logits
  and log-probabilities within 1e-4;
- `salloc -n 3 dist-infer serve --placement slurm --instances "tp2; tp1"`: the front end runs in the
  allocation and starts each instance as a job step of its own (two steps side by side on the node,
  each meeting on a port of its own); completions on both match transformers' greedy ids, and
  /admin/instances and squeue show each instance and its step;
- the README's serve.sbatch: the batch script (SLURM_PROCID=0, no step) is the front end (`exec`),
  not a rank; its one instance a step; `scancel --batch --signal=TERM` stops it in order, exit 0.
"""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest
import torch

from tests.support.checkpoints import hf_reference, write_hf_checkpoint
from tests.support.hf_compare import assert_ids_match_hf, assert_matches_hf, prompts_for
from tests.support.paths import REPO, VENV_BIN
from tests.support.processes import finish, run, start, venv_env
from tests.support.serving_helpers import ServerJob, instances
from tests.support.slurm_cluster import OneHostSlurm, SlurmUnavailable

NEW = 6
PROMPTS = prompts_for([5, 11], seed=81)
DIST = str(VENV_BIN / "dist-infer")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        cluster = OneHostSlurm(tmp_path_factory.mktemp("slurm")).start()
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("slurm-model"), "llama-gqa", num_hidden_layers=4)


def _env(slurm) -> dict[str, str]:
    """The tests' environment (no launcher variables) with this checkout first on sys.path and the
    one-host cluster's slurm.conf."""
    return slurm.env(venv_env({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}))


def test_srun_generate_tp2_pp2_matches_hf(slurm, model, tmp_path):
    dump = tmp_path / "logits.pt"
    cmd = [
        "srun",
        "--ntasks",
        "4",
        "--kill-on-bad-exit=1",
        DIST,
        "generate",
        "--model",
        model,
        "--tp",
        "2",
        "--pp",
        "2",
        "--max-new-tokens",
        NEW,
        "--no-eos-stop",
        "--json",
        "--dump-logits",
        dump,
    ]
    for p in PROMPTS:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    proc = run(cmd, 120, env=_env(slurm))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}\n{slurm.logs()}"
    assert "4 ranks via slurm" in proc.stderr, proc.stderr[-3000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])
    assert (out["parallel"]["tp"], out["parallel"]["pp"], out["parallel"]["world_size"]) == (2, 2, 4)
    ref_ids, ref_logits = hf_reference(model, PROMPTS, NEW)
    assert_matches_hf(out, torch.load(dump), PROMPTS, ref_ids, ref_logits, "srun -n 4 --tp 2 --pp 2")


def test_serve_placement_slurm_runs_each_instance_as_a_job_step(slurm, model, tmp_path):
    args = [
        "--model",
        model,
        "--placement",
        "slurm",
        "--instances",
        "tp2; tp1",
        "--dispatch",
        "rr",
        "--migrate-interval",
        "0",
        "--kv-blocks",
        "64",
        "--timeout",
        "60",
    ]
    with ServerJob(tmp_path, args, prefix=["salloc", "--ntasks", "3", DIST], env=_env(slurm)) as job:
        insts = instances(job)
        assert [(i["layout"], i["state"], i["node"]) for i in insts] == [
            ("tp=2", "serving", slurm.node),
            ("tp=1", "serving", slurm.node),
        ], insts
        steps = subprocess.run(
            ["squeue", "--steps", "--noheader", "--format", "%j %N"],
            env=_env(slurm),
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
        for index in (0, 1):
            assert f"dist-infer-instance-{index}-" in steps, steps
        got = []
        for p in PROMPTS:  # round robin: one on each instance
            r = httpx.post(
                job.url + "/v1/completions",
                timeout=120,
                json={"prompt": p, "max_tokens": NEW, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        assert job.stop(api_only=True) == 0, job.log()[-6000:]
    assert_ids_match_hf(model, PROMPTS, got, NEW, "serve --placement slurm")
    log = job.log_path.read_text(errors="replace")
    assert "job step dist-infer-instance-0-" in log and "job step dist-infer-instance-1-" in log, log[-4000:]


def test_sbatch_serve_placement_slurm_stops_in_order(slurm, model, tmp_path):
    ready = tmp_path / "ready.json"
    script = tmp_path / "serve.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --job-name=serve-sbatch-test
#SBATCH --output={tmp_path}/serve.out
exec {DIST} serve --model {model} --placement slurm --instances tp1 --kv-blocks 64 --timeout 60 --port 0 \\
    --ready-file {ready}
""")
    env = _env(slurm)
    proc = start(["sbatch", "--wait", "--parsable", script], env=env)
    deadline = time.monotonic() + 90
    while not (ready.is_file() and ready.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.out").read_text()[-4000:]
        time.sleep(0.2)
    url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"
    r = httpx.post(
        url + "/v1/completions",
        timeout=120,
        json={"prompt": PROMPTS[1], "max_tokens": NEW, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    job_id = subprocess.run(
        ["squeue", "--noheader", "--name", "serve-sbatch-test", "--format", "%i"],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.split()
    assert len(job_id) == 1, job_id
    subprocess.run(["scancel", "--batch", "--signal=TERM", job_id[0]], env=env, check=True, timeout=10)
    done = finish(proc, 60)
    log = (tmp_path / "serve.out").read_text(errors="replace")
    assert done.returncode == 0 and "server stopped" in log, log[-4000:]
    assert_ids_match_hf(model, [PROMPTS[1]], [r.json()["choices"][0]["token_ids"]], NEW, "sbatch serve")

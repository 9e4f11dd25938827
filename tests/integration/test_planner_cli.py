"""The planner through the real CLI and in real processes: `dist-infer plan` ranks layouts and
explains them, bad input names the thing, `calibrate --quick` writes a usable profile, `bench
--sweep` runs two layouts beside their predictions, and neither importing the planner nor running
`dist-infer plan` loads torch. (The cost model itself, in process: tests/unit/planner/, one test file per module.)"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Optional

import pytest

from dist_infer.planner.hardware import Link, load_profile, save_profile
from dist_infer.planner.layout import candidate_layouts
from tests.support.plan_profiles import SMALL, gemm_only_profile

SMALL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def dist_infer(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dist_infer", *args], capture_output=True, text=True, timeout=timeout)


def cli(capsys, *args: str) -> tuple[int, str]:
    """The command line in this process (exit code, stdout): what `dist-infer ARGS` runs, without
    a process start for each of the many small plan calls (one test starts the real command)."""
    from loguru import logger

    from dist_infer.cli.main import main

    capsys.readouterr()
    try:
        code = main(list(args))
    finally:
        logger.disable("dist_infer")  # main enables the library's logs; the test process keeps them off
    return code, capsys.readouterr().out


def cpu_profile(path, reference: Optional[dict] = None) -> str:
    prof = gemm_only_profile(
        rate=1e10,
        memory_bandwidth=1e10,
        attention_flops={"fp32": 1e10},
        device="cpu",
        memory_bytes=8 * 2**30,
        devices_per_node=2,
        shared_node=True,
        links={"intra": Link(1e-4, 1e9)},
        per_layer_s=1e-4,
        per_step_s=1e-3,
        reference=reference or {},
    )
    save_profile(prof, str(path))
    return str(path)


def test_plan_cli_ranks_layouts_and_explains(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL_CONFIG))
    prof = cpu_profile(tmp_path / "cpu.json")
    out = dist_infer(
        "plan",
        "--model",
        str(cfg),
        "--gpus",
        "4",
        "--profile",
        prof,
        "--prompt-len",
        "512",
        "--gen-len",
        "16",
        "--batch",
        "2",
        "--json",
    )
    assert out.returncode == 0, out.stderr + out.stdout
    result = json.loads(out.stdout.strip().splitlines()[-1])
    lays = result["layouts"]
    assert {(x["tp"], x["pp"], x["cp"]) for x in lays} == {
        (lay.tp, lay.pp, lay.cp) for lay in candidate_layouts(SMALL, 4)
    }
    keys = [x["ttft_s"] + 15 * x["tpot_s"] for x in lays]
    assert keys == sorted(keys)  # best first
    for x in lays:
        assert {"tp", "pp", "cp", "ep", "ttft_s", "tpot_s", "memory_gib_per_rank", "dominant_prefill"} <= set(x)
    assert "best: " in out.stdout and "prefill bound by" in out.stdout
    assert "prefill schedules" in out.stdout and set(result["prefill_schedules"]) == {"chunked", "layered"}
    code, one = cli(
        capsys, "plan", "--model", str(cfg), "--gpus", "4", "--profile", prof, "--layout", "tp=2,pp=2", "--json"
    )
    assert code == 0 and [(x["tp"], x["pp"]) for x in json.loads(one.strip().splitlines()[-1])["layouts"]] == [(2, 2)]


def test_plan_cli_bad_input_names_the_thing(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL_CONFIG))
    code, out = cli(capsys, "plan", "--model", str(cfg), "--gpus", "4", "--layout", "tp=3")
    assert code == 2 and "--layout tp=3: needs 3 ranks (tp x pp x cp x ep), not 4" in out
    code, out = cli(capsys, "plan", "--model", str(cfg), "--gpus", "4", "--profile", "nope")
    assert code == 2 and "no hardware profile 'nope'" in out
    code, out = cli(capsys, "plan", "--model", str(tmp_path / "missing"), "--gpus", "4")
    assert code == 2 and "no such file or directory" in out
    code, out = cli(capsys, "plan", "--model", str(cfg), "--gpus", "4", "--max-batched-tokens", "8")
    assert code == 2 and "--max-batched-tokens 8 leaves no room beside --running-decodes 8" in out
    code, out = cli(capsys, "plan", "--model", "mixtral-8x7b", "--gpus", "8", "--layout", "tp=8")
    assert code == 0 and "expert weights read" in out, out
    out = dist_infer("bench", "--model", "tiny", "--sweep", "tp=1,2", "--hardware-profile", str(tmp_path / "none.json"))
    assert out.returncode == 2 and "no hardware profile" in out.stdout and "none.json" in out.stdout
    out = dist_infer("bench", "--model", "tiny", "--sweep", "tp=1,2", "--sweep-rounds", "0")
    assert out.returncode == 2 and "--sweep-rounds 0" in out.stdout
    # nothing fits: a 405B model on one 80 GB GPU
    code, out = cli(capsys, "plan", "--model", "llama3.1-405b", "--gpus", "1", "--profile", "h100")
    assert code == 1 and "no layout of 1 ranks fits" in out


@pytest.mark.timeout(960)  # about 100 s on a quiet 2-core machine, several times that beside other work
def test_calibrate_quick_writes_a_usable_profile(tmp_path):
    out = dist_infer("calibrate", "--quick", "--out", str(tmp_path / "p.json"), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    prof = load_profile(str(tmp_path / "p.json"))
    assert prof.device == "cpu" and prof.shared_node
    assert prof.gemm_rate("fp32", 1, 256) > 1e8 and prof.bandwidth(1) > 1e8
    assert prof.link("all_reduce", 2, "shm").busbw > 0 and prof.link("send_recv", 2, "intra").busbw > 0
    # fixed costs are differences of two timings: on a loaded machine one may come out 0 (calibrate warns)
    assert prof.per_layer_s >= 0 and prof.per_step_s >= 0 and prof.cp_step_s >= 0 and prof.cp_decode_layer_s >= 0
    # every 2-rank layout's decode fixed costs, timed in that layout (--quick: not the 4-rank ones)
    assert set(prof.decode_fixed) == set(prof.prefill_fixed) == {"tp=2", "pp=2", "cp=2"}
    # (each a difference of timings: either part may come out 0)
    for name, cost in [*prof.decode_fixed.items(), *prof.prefill_fixed.items()]:
        assert cost["per_layer_s"] >= 0 and cost["per_step_s"] >= 0, (name, cost)
        assert cost["per_step_s"] + 4 * cost["per_layer_s"] > 0, (name, cost)  # the 4-layer step itself
    assert prof.reference["gemm_flops"] > 1e8 and prof.reference["stream_bandwidth"] > 1e8
    assert prof.kv_bandwidth(1, 64) > 1e8
    # the decode attention's rate by head size, KV heads per rank and context, each measured
    assert sorted(prof.decode_attention_bandwidth["1"]) == ["128", "32", "64"]
    assert list(prof.decode_attention_bandwidth["1"]["32"]) == ["1", "2", "3", "4", "6", "8"]
    assert [ctx for ctx, _ in prof.decode_attention_bandwidth["1"]["32"]["2"]] == [4096, 8192]  # (--quick)
    # how fast matrices of each size stream against the largest (the largest: 1)
    for curve in prof.stream_size_factor.values():
        assert [round(b / 2**20, 2) for b, _ in curve] == [0.25, 1, 4, 16] and curve[-1][1] == 1.0
        assert all(0 < f < float("inf") for _, f in curve)  # measured ratios: no bound on their size here


def test_sweep_runs_two_layouts_beside_their_predictions(tmp_path):
    prof = cpu_profile(tmp_path / "cpu.json", reference={"threads": 2, "gemm_flops": 1e11, "stream_bandwidth": 2e10})
    png = tmp_path / "sweep.png"
    out = dist_infer(
        "bench",
        "--model",
        "tiny",
        "--sweep",
        "tp=1,2",
        "--hardware-profile",
        prof,
        "--batch",
        "2",
        "--prompt-len",
        "32",
        "--gen-len",
        "4",
        "--json",
        "--plot",
        str(png),
        "--sweep-speed-check",
        "on",
        "--sweep-rounds",
        "2",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])["sweep"]
    assert [r["layout"] for r in rows] == ["tp=1", "tp=2"]
    for r in rows:
        assert r["measured"]["ttft_s"] > 0 and r["predicted"]["ttft_s"] > 0
        # two rounds, one launch of each layout in each: each metric's median over them is compared
        assert len(r["rounds"]) == 2
        assert r["measured"]["ttft_s"] == pytest.approx(statistics.median(x["ttft_s"] for x in r["rounds"]))
        assert r["measured"]["tpot_median_s"] == pytest.approx(
            statistics.median(x["tpot_median_s"] for x in r["rounds"])
        )
        assert r["ttft_error"] == pytest.approx(r["predicted"]["ttft_s"] / r["measured"]["ttft_s"] - 1)
        assert r["measured"]["peak_rss_gib_per_rank"] > 0.1 and r["memory_error"] is not None
        # the speed check: `calibrate --reference` timed before the run, the prediction scaled to it
        speed = r["machine_speed"]
        assert speed["compute"] > 0 and speed["memory"] > 0
        assert r["predicted_at_profile_speed"]["ttft_s"] > 0 and r["predicted"] != r["predicted_at_profile_speed"]
    assert rows[0]["efficiency_prefill_tok_s"] == pytest.approx(1.0)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "sweep: " in out.stdout and "err" in out.stdout


# -- the planner without torch ---------------------------------------------------------------------


NO_TORCH = "import sys; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"


def test_importing_the_planner_loads_no_torch():
    code = (
        "import dist_infer.planner, dist_infer.planner.plan, dist_infer.planner.predict, "
        "dist_infer.planner.calibrate, dist_infer.cli.main, dist_infer.cli.parser; " + NO_TORCH
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_cli_parser_needs_no_serving_extra():
    """`generate` and `bench` work where the serve extra (fastapi, starlette, uvicorn) is not installed:
    building the whole parser imports none of it (a GPU image without it found this)."""
    code = (
        "import sys\n"
        "from dist_infer.cli.parser import build_parser\n"
        "build_parser().parse_args(['generate', '--max-new-tokens', '2'])\n"
        "extra = sorted(m for m in sys.modules if m.split('.')[0] in ('starlette', 'fastapi', 'uvicorn'))\n"
        "assert not extra, extra\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dist_infer_plan_runs_without_torch():
    # the README's example, run through the real CLI entry point; an import hook refuses torch
    code = (
        "import sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('dist-infer plan imported torch')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from dist_infer.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = [
        "plan",
        "--model",
        "llama3.1-405b",
        "--gpus",
        "128",
        "--gpus-per-node",
        "8",
        "--prompt-len",
        "131072",
        "--gen-len",
        "128",
        "--profile",
        "h100",
        "--json",
    ]
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "tp=" in out.stdout

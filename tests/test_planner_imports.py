"""The planner is arithmetic: importing it, or running `dist-infer plan`, must load no torch; and the
numbers it copies from the engine (to stay torch-free) must equal the engine's own."""

import subprocess
import sys

NO_TORCH = "import sys; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"


def test_importing_the_planner_loads_no_torch():
    code = ("import dist_infer.planner, dist_infer.planner.plan, dist_infer.planner.predict, "
            "dist_infer.planner.calibrate, dist_infer.cli.main, dist_infer.cli.parser; " + NO_TORCH)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dist_infer_plan_runs_without_torch():
    # the README's example, run through the real CLI entry point; an import hook refuses torch
    code = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError('dist-infer plan imported torch')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "from dist_infer.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    argv = ["plan", "--model", "llama3.1-405b", "--gpus", "128", "--gpus-per-node", "8", "--prompt-len", "131072",
            "--gen-len", "128", "--profile", "h100", "--json"]
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "tp=" in out.stdout


def test_engine_facts_match_the_engine():
    from dist_infer.comm import shm, shm_sizes
    from dist_infer.engine.step_loop import OVERLAP_THRESHOLDS
    from dist_infer.models.llama import LlamaMLP
    from dist_infer.parallel import overlap_policy, token_split
    from dist_infer.planner import engine_facts

    assert engine_facts.MLP_ROW_CHUNK == LlamaMLP.ROW_CHUNK
    assert engine_facts.OVERLAP_THRESHOLDS == OVERLAP_THRESHOLDS
    assert (shm.NBUF, shm.DEFAULT_SLOT_BYTES) == (shm_sizes.NBUF, shm_sizes.DEFAULT_SLOT_BYTES)
    assert token_split.should_split is overlap_policy.should_split

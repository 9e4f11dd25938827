"""Expert-parallel MoE generation through the real CLI, compared with HF transformers.

Every case writes a small seeded Mixtral / Qwen2-MoE / Qwen3-MoE checkpoint (8 experts, top-2,
hidden 64), runs `dist-infer generate` as real processes (its own local ranks, torchrun or
mpirun; gloo and MPI), and checks against HF's fp32 eager greedy decoding of the same prompts:

- greedy token ids identical (the only excuse for a difference is a near tie in HF's logits at
  the first differing step, top-2 gap < 1e-4, which the assertion message then states);
- every step's logits (from --dump-logits) within atol 1e-4 / rtol 1e-4.

Also: a router forced to send every token to one rank's experts (still exact, and the routing
statistics show the skew), a measured routing file turned into a placement and used, and the
all-to-all with empty splits on gloo and on MPI.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dist_infer.topology import free_port
from tests.support.hf_compare import CheckpointStore, assert_matches_hf, prompts_for
from tests.support.processes import last_json, run

JOB_TIMEOUT = 180  # a case takes 5-20 s here; this only bounds a hang
NEW_TOKENS = 6
SHORT = (5, 17, 40)
FORCED = (0, 1)  # the experts the forced checkpoint routes every token to: rank 0's for ep 2 and 4
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


def torchrun(n: int) -> list[str]:
    return ["torchrun", "--nproc-per-node", str(n), "--master-port", str(free_port()), "--no-python", "dist-infer"]


def mpirun(n: int) -> list[str]:
    return [*MPIRUN, "-np", str(n), "dist-infer"]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("moe"), NEW_TOKENS)


def generate(prefix: list[str], model: Path, prompts, dump: Path, flags: list[str]) -> dict:
    cmd = [
        *prefix,
        "generate",
        "--model",
        str(model),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--no-eos-stop",
        "--json",
        "--dump-logits",
        str(dump),
        *flags,
    ]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    result = run(cmd, JOB_TIMEOUT)
    assert result.returncode == 0, f"exit {result.returncode}: {' '.join(cmd)}\n{result.stderr[-4000:]}"
    return last_json(result.stdout)


def flag(flags: list[str], name: str, default: int = 1) -> int:
    return int(flags[flags.index(name) + 1]) if name in flags else default


# id: (arch, checkpoint options, prompt lengths, launcher prefix, generate flags)
CASES = {
    "mixtral-ep1": ("mixtral", {}, SHORT, ["dist-infer"], ["--nproc", "1"]),
    "mixtral-ep2-batch1": ("mixtral", {}, (17,), ["dist-infer"], ["--ep", "2"]),
    "mixtral-ep4": ("mixtral", {}, SHORT, ["dist-infer"], ["--ep", "4"]),
    "mixtral-ep2xtp2-mpi": ("mixtral", {}, SHORT, mpirun(4), ["--ep", "2", "--tp", "2", "--backend", "mpi"]),
    "mixtral-ep2xpp2-torchrun": ("mixtral", {}, SHORT, None, ["--ep", "2", "--pp", "2"]),
    "forced-ep2-mpirun-gloo": (
        "mixtral",
        {"force_experts": FORCED},
        SHORT,
        mpirun(2),
        ["--ep", "2", "--backend", "gloo"],
    ),
    "forced-ep4": ("mixtral", {"force_experts": FORCED}, SHORT, ["dist-infer"], ["--ep", "4"]),
    "qwen2moe-ep2xpp2": ("qwen2-moe", {}, SHORT, ["dist-infer"], ["--ep", "2", "--pp", "2"]),
    "qwen2moe-ep2xtp2": ("qwen2-moe", {}, SHORT, ["dist-infer"], ["--ep", "2", "--tp", "2"]),
    "qwen3moe-ep2xtp2-overlap": ("qwen3-moe", {}, SHORT, ["dist-infer"], ["--ep", "2", "--tp", "2", "--overlap", "on"]),
    "mixtral-ep2xcp2": ("mixtral", {}, SHORT, ["dist-infer"], ["--ep", "2", "--cp", "2"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_hf(case, store, tmp_path):
    arch, options, lengths, prefix, flags = CASES[case]
    model = store.model(arch, **options)
    prompts = prompts_for(lengths)
    ref_ids, ref_logits = store.reference(model, prompts)
    dump = tmp_path / "logits.pt"
    ep, tp, pp, cp = flag(flags, "--ep"), flag(flags, "--tp"), flag(flags, "--pp"), flag(flags, "--cp")
    out = generate(prefix or torchrun(ep * tp * pp * cp), model, prompts, dump, flags)
    par = out["parallel"]
    assert (par["ep"], par["tp"], par["pp"], par["cp"], par["world_size"]) == (ep, tp, pp, cp, ep * tp * pp * cp), par
    if "--backend" in flags:
        assert flags[flags.index("--backend") + 1] in par["backend"], par
    assert_matches_hf(out, torch.load(dump), prompts, ref_ids, ref_logits, case)

    moe = out["moe"]
    sparse = [i for i in range(3 if arch == "qwen2-moe" else 2) if not (arch == "qwen2-moe" and i == 1)]
    assert sorted(int(i) for i in moe["layers"]) == sparse, "every sparse layer (all stages) reports its routing"
    last_layer = (3 if arch == "qwen2-moe" else 2) - 1

    def routed(i) -> int:
        """Tokens through layer i's router: all of them, except in the model's last layer, whose
        prefill keeps only each prompt's last token (nothing reads the other rows' outputs)."""
        if int(i) == last_layer and cp == 1:
            return len(lengths) * NEW_TOKENS
        return sum(lengths) + len(lengths) * (NEW_TOKENS - 1)

    for i, layer in moe["layers"].items():
        if cp == 1:  # with cp, the statistics are those of world rank 0's cp shard of the prompts
            assert sum(layer["tokens_per_expert"]) == routed(i) * 2, (
                f"layer {i}: every (token, expert) pair, none dropped"
            )
    if "force_experts" in options:
        for i, layer in moe["layers"].items():
            assert layer["tokens_per_rank"] == [routed(i) * 2] + [0] * (ep - 1), f"layer {i}: {layer}"
            assert layer["imbalance"] == ep and layer["step_imbalance_mean"] == ep
        assert moe["imbalance"] == ep


def test_measured_routing_becomes_a_placement(store, tmp_path):
    """bench --save-routing measures tokens per expert; generate --expert-placement uses the balanced placement."""
    model = store.model("mixtral")
    routing = tmp_path / "routing.json"
    bench = run(
        [
            "dist-infer",
            "bench",
            "--model",
            str(model),
            "--ep",
            "2",
            "--batch",
            "2",
            "--prompt-len",
            "12",
            "--gen-len",
            "3",
            "--save-routing",
            str(routing),
            "--json",
        ],
        JOB_TIMEOUT,
    )
    assert bench.returncode == 0, bench.stderr[-4000:]
    summary = last_json(bench.stdout)
    assert summary["ep"] == 2 and set(summary["moe"]["time_s_mean"]) == {
        "route",
        "dispatch",
        "experts",
        "combine",
        "gather",
    }
    assert "dispatch+combine / experts" in bench.stdout
    saved = json.loads(routing.read_text())
    # the timed run only: prefill, then two decode steps; the last layer (1) routes only each
    # prompt's last token in prefill (the rows nobody reads are dropped before its MLP)
    timed_tokens = {"0": 2 * 12 + 2 * (3 - 1), "1": 2 + 2 * (3 - 1)}
    for i, layer in summary["moe"]["layers"].items():
        assert (
            saved["counts"][i] == layer["tokens_per_expert"]
            and sum(layer["tokens_per_expert"]) == timed_tokens[str(i)] * 2
        )
        assert saved["imbalance_balanced"][i] <= saved["imbalance_contiguous"][i]
    contiguous = {i: [0, 0, 0, 0, 1, 1, 1, 1] for i in saved["placement"]}
    assert saved["placement"] != contiguous, "the measured skew should move some experts"

    prompts = prompts_for(SHORT)
    dump = tmp_path / "logits.pt"
    out = generate(["dist-infer"], model, prompts, dump, ["--ep", "2", "--expert-placement", str(routing)])
    for i, layer in out["moe"]["layers"].items():
        assert layer["placement"] == saved["placement"][i]
    assert_matches_hf(out, torch.load(dump), prompts, *store.reference(model, prompts), "placement from file")


A2A_CHECK = textwrap.dedent('''
    """All-to-all with empty splits, every pattern an MoE step can produce, blocking and async."""
    import sys
    import torch
    from dist_infer.comm import init_world

    world = init_world(sys.argv[1], timeout=60)
    r, n, W = world.rank, world.size, 3

    def block(src, dst, rows):
        return torch.arange(rows * W, dtype=torch.float32).view(rows, W) + 1000 * src + 100 * dst

    patterns = {
        "rank 0 sends and receives nothing": lambda s, d: 0 if 0 in (s, d) else s + d,
        "every row to rank 0": lambda s, d: s + 1 if d == 0 else 0,
        "nothing at all": lambda s, d: 0,
        "only to itself": lambda s, d: 2 if s == d else 0,
        "unequal, some zero": lambda s, d: (s + d) % 3,
    }
    for name, rows in patterns.items():
        for async_op in (False, True):
            send = [rows(r, d) for d in range(n)]
            recv = [rows(s, r) for s in range(n)]
            data = torch.cat([block(r, d, send[d]) for d in range(n)])
            out = torch.full((sum(recv), W), -1.0)
            handle = world.all_to_all(out, data, recv, send, async_op=async_op)
            if handle is not None:
                handle.wait()
            want = torch.cat([block(s, r, recv[s]) for s in range(n)])
            assert torch.equal(out, want), f"rank {r}, {name}, async {async_op}: {out.tolist()} != {want.tolist()}"
    world.barrier()
    print(f"rank {r}: all-to-all ok on {world.backend}")
    world.destroy()
''')


@pytest.mark.parametrize("launcher", ["torchrun-gloo", "mpirun-mpi"])
def test_all_to_all_with_empty_splits(launcher, tmp_path):
    script = tmp_path / "a2a_check.py"
    script.write_text(A2A_CHECK)
    if launcher == "torchrun-gloo":
        cmd = ["torchrun", "--nproc-per-node", "4", "--master-port", str(free_port()), str(script), "gloo"]
    else:
        cmd = [*MPIRUN, "-np", "4", sys.executable, str(script), "mpi"]
    result = run(cmd, JOB_TIMEOUT)
    assert result.returncode == 0, result.stderr[-4000:]
    backend = "gloo" if launcher == "torchrun-gloo" else "mpi"
    assert result.stdout.count(f"all-to-all ok on {backend}") == 4, result.stdout  # ranks' lines may interleave

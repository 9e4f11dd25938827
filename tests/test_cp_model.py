"""The full model with context parallelism, through the real CLI, against HF transformers.

A long prompt is prefilled with each cp rank holding its zigzag share of the tokens and of the
KV cache (ring attention across the ranks), then decoding continues over the sharded cache
(each rank attends to its shard, the partials merged by log-sum-exp, new tokens' KV placed
round-robin). Checked like every parallel path here: greedy ids identical to HF's fp32 eager
decoding (a near tie in HF's logits, top-2 gap < 1e-4, is the only excuse, and the message
says so) and every step's logits within 1e-4 -- so decode after a cp prefill keeps matching.

The bookkeeping (which rank holds which positions, who stores a decode token, the merge of
shard partials) is also checked in-process, without processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist_infer.kernels import load_cpu_kernels
from conftest import run

from dist_infer.models.cp_attention import (
    ContextParallelError,
    cp_decode_metadata,
    cp_decode_owner,
    cp_prefill_metadata,
    shard_decode_attention,
)
from dist_infer.parallel.ring.lse import merge_many

sys.path.insert(0, str(Path(__file__).parent))
from hf_compare import CheckpointStore, assert_matches_hf, prompts_for  # noqa: E402

NEW_TOKENS = 6
TIMEOUT_S = 180  # a healthy run takes 10-20 s on 2 cores; this only bounds a hang
LENGTHS = (3, 45, 150)  # 3 tokens: with cp 4 some ranks hold none of that prompt
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


# -- bookkeeping, in-process ---------------------------------------------------------------------

@pytest.mark.parametrize("cp", [2, 3, 4])
def test_prefill_metadata_splits_every_prompt_exactly_once(cp):
    lens = [3, 45, 150]
    held = {b: [] for b in range(len(lens))}
    last_owners = {b: [] for b in range(len(lens))}
    for r in range(cp):
        tables = [list(range(100 * b, 100 * b + 20)) for b in range(len(lens))]
        meta, mine = cp_prefill_metadata(lens, cp, r, tables, 16, q_heads=4, kv_heads=2)
        assert meta.cp.variant == "pass-kv", "a fresh prefill of a GQA model moves the KV"
        flat = [p for pos in mine for p in pos]
        assert meta.positions.tolist() == flat
        assert len(set(meta.slot_mapping.tolist())) == len(flat), "each local token gets its own cache slot"
        row = 0
        for b, pos in enumerate(mine):
            held[b] += pos
            assert max(pos, default=-1) <= lens[b] - 1 and len(pos) <= -(-lens[b] // (2 * cp)) * 2
            last = int(meta.cp.last_rows[b])
            if last >= 0:
                last_owners[b].append(r)
                assert flat[last] == lens[b] - 1 and row <= last < row + len(pos)
            row += len(pos)
    for b, n in enumerate(lens):
        assert sorted(held[b]) == list(range(n)), f"prompt {b}"
        assert len(last_owners[b]) == 1, f"prompt {b}: last token on ranks {last_owners[b]}"


def test_auto_variant_for_a_fresh_prefill():
    table = [list(range(100))]
    for heads, kv_heads, prompt, want in ((4, 2, 40, "pass-kv"),  # GQA: Q is as large as K+V
                                          (4, 4, 40, "pass-q"),  # MHA, 20 tokens per rank: K+V too big to hide
                                          (4, 4, 1000, "pass-kv")):  # MHA, 500 per rank: its transfer hides
        meta, _ = cp_prefill_metadata([prompt], 2, 0, table, 16, q_heads=heads, kv_heads=kv_heads)
        assert meta.cp.variant == want, (heads, kv_heads, prompt)
    assert cp_prefill_metadata([40], 2, 0, table, 16, "pass-q", 4, 2)[0].cp.variant == "pass-q", "forced"


def test_decode_tokens_go_round_robin_and_shards_stay_even():
    cp, prompt = 4, 150
    counts = [len(cp_prefill_metadata([prompt], cp, r, [list(range(20))], 16)[1][0]) for r in range(cp)]
    spread = max(counts) - min(counts)
    for t in range(40):
        owner = cp_decode_owner(prompt + t, prompt, cp)
        assert owner == t % cp
        counts[owner] += 1
        assert max(counts) - min(counts) <= spread + 1, counts
    assert sum(counts) == prompt + 40


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native-kernel"])
def test_sharded_decode_merges_to_attention_over_the_whole_cache(native):
    """Each rank's partial (output, LSE) over its shard, merged, is attention over every key; the
    native kernel's partials (one call through the block table) as well as torch's."""
    kernels = load_cpu_kernels() if native else None
    if native and kernels is None:
        pytest.skip("no C compiler: the native kernels do not build here")
    gen = torch.Generator().manual_seed(0)
    cp, heads, kv_heads, d, bs = 3, 4, 2, 8, 4
    lens = [[5, 0, 9], [1, 2, 3]]  # keys of each sequence on each rank; sequence 0 has none on rank 1
    q = torch.randn(2, heads, d, generator=gen)
    keys = [[torch.randn(n, kv_heads, d, generator=gen) for n in per] for per in lens]
    vals = [[torch.randn(n, kv_heads, d, generator=gen) for n in per] for per in lens]
    parts_o, parts_l = [], []
    for r in range(cp):
        k_cache, v_cache = torch.zeros(8, bs, kv_heads, d), torch.zeros(8, bs, kv_heads, d)
        tables = [[2 * b, 2 * b + 1, 7 - b] for b in range(2)]
        for b in range(2):
            for i in range(lens[b][r]):
                slot = tables[b][i // bs] * bs + i % bs
                k_cache.view(-1, kv_heads, d)[slot] = keys[b][r][i]
                v_cache.view(-1, kv_heads, d)[slot] = vals[b][r][i]
        meta = cp_decode_metadata([40, 41], [False, False], [lens[0][r], lens[1][r]], tables, bs)
        o, lse = shard_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, d ** -0.5, kernels)
        if lens[0][r] == 0:
            assert torch.isneginf(lse[0]).all() and (o[0] == 0).all()
        parts_o.append(o), parts_l.append(lse)
    got, _ = merge_many(torch.stack(parts_o), torch.stack(parts_l))
    for b in range(2):
        k_all = torch.cat(keys[b]).repeat_interleave(heads // kv_heads, 1)
        v_all = torch.cat(vals[b]).repeat_interleave(heads // kv_heads, 1)
        probs = torch.softmax(torch.einsum("hd,khd->hk", q[b], k_all) * d ** -0.5, -1)
        torch.testing.assert_close(got[b], torch.einsum("hk,khd->hd", probs, v_all), atol=1e-6, rtol=1e-6)


def test_decode_metadata_stores_only_this_ranks_tokens():
    meta = cp_decode_metadata([10, 20], [True, False], [3, 7], [[5], [6]], 16)
    assert meta.cp.store_rows.tolist() == [0]
    assert meta.slot_mapping.tolist() == [5 * 16 + 2], "stored as the last row of the shard"


def test_unsupported_cp_setups_are_refused_with_the_numbers():
    from dist_infer.engine.step_loop import Engine

    groups = SimpleNamespace(cp=SimpleNamespace(size=2, rank=0), pp=SimpleNamespace(size=2), tp=SimpleNamespace(size=1))
    with pytest.raises(ContextParallelError, match=r"cp with pp is not supported yet \(cp=2, pp=2\)"):
        Engine(SimpleNamespace(cfg=None, cp=object()), groups)
    with pytest.raises(ContextParallelError, match="cp variant 'ring' is not one of"):
        Engine(SimpleNamespace(cfg=None, cp=object()), groups, cp_variant="ring")
    with pytest.raises(ContextParallelError, match="prompt of 300 tokens exceeds the model's window of 256"):
        cp_prefill_metadata([300], 2, 0, [list(range(20))], 16, sliding_window=256)


# -- the model through the CLI, against HF ----------------------------------------------------------

@pytest.fixture(scope="module")
def store(tmp_path_factory) -> CheckpointStore:
    return CheckpointStore(tmp_path_factory.mktemp("cp"), NEW_TOKENS)


# id: (arch, launcher prefix or None for dist-infer's own local ranks, flags)
CASES = {
    "cp2": ("llama-gqa", None, ["--cp", "2", "--nproc", "2"]),
    "cp4": ("llama-gqa", None, ["--cp", "4", "--nproc", "4"]),
    "cp2xtp2": ("llama-gqa", None, ["--cp", "2", "--tp", "2", "--nproc", "4"]),
    "cp2-pass-q": ("llama-gqa", None, ["--cp", "2", "--cp-variant", "pass-q", "--nproc", "2"]),
    "mqa-cp3": ("llama-mqa", None, ["--cp", "3", "--nproc", "3"]),
    "mpirun-mpi-cp2xtp2": ("llama-gqa", [*MPIRUN, "-np", "4"], ["--cp", "2", "--tp", "2", "--backend", "mpi"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_cp_generate_matches_hf(case, store, tmp_path):
    arch, prefix, flags = CASES[case]
    prompts = prompts_for(LENGTHS, seed=4321)
    ref_ids, ref_logits = store.reference(store.model(arch, max_position_embeddings=256), prompts)
    dump = tmp_path / "logits.pt"
    cmd = [*(prefix or []), "dist-infer", "generate", "--model", str(store.model(arch, max_position_embeddings=256)),
           "--max-new-tokens", str(NEW_TOKENS), "--no-eos-stop", "--json", "--dump-logits", str(dump), *flags]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    result = run(cmd, TIMEOUT_S)
    assert result.returncode == 0, f"{case} exited {result.returncode}"
    out = json.loads([ln for ln in result.stdout.splitlines() if ln.strip()][-1])
    cp = int(flags[flags.index("--cp") + 1])
    tp = int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1
    assert (out["parallel"]["cp"], out["parallel"]["tp"], out["parallel"]["world_size"]) == (cp, tp, cp * tp)
    if "--backend" in flags:
        assert "mpi" in out["parallel"]["backend"]
    assert_matches_hf(out, torch.load(dump), prompts, ref_ids, ref_logits, case)


@pytest.mark.slow
def test_a_64k_prompt_with_cp2_matches_the_single_process_flash_reference(tmp_path):
    """A 65536-token prompt, cp=2, against one process that attends the whole sequence with torch's
    CPU flash kernel (the reference that can afford this length: HF's eager attention would build
    a 64K x 64K score matrix per head). The single-process path is itself checked against HF at
    every length above. Greedy ids identical, each step's logits within fp32 tolerance."""
    from checkpoints import write_hf_checkpoint

    model = write_hf_checkpoint(tmp_path, "llama-gqa", subdir="tiny-64k", hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                max_position_embeddings=65600, rope_theta=1e6)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(",".join(map(str, prompts_for([65536], seed=64)[0])))
    outs = {}
    for name, flags in (("one process", ["--nproc", "1"]), ("cp=2", ["--cp", "2"])):
        dump = tmp_path / f"{name}.pt"
        result = run(["dist-infer", "generate", "--model", str(model), "--prompt-ids", f"@{prompt_file}",
                      "--max-new-tokens", "3", "--no-eos-stop", "--json", "--dump-logits", str(dump), *flags], 300)
        assert result.returncode == 0, f"{name} exited {result.returncode}"
        out = json.loads([ln for ln in result.stdout.splitlines() if ln.strip()][-1])
        outs[name] = (out["outputs"][0]["token_ids"], torch.load(dump)[0])
    (ids1, logits1), (ids2, logits2) = outs["one process"], outs["cp=2"]
    assert ids2 == ids1, f"cp=2 {ids2} vs one process {ids1}"
    assert torch.allclose(logits2, logits1, atol=1e-4, rtol=1e-4), float((logits2 - logits1).abs().max())


def test_cp_auto_rewrites_the_ranks_command_line(monkeypatch):
    from dist_infer.cli import cp_auto
    from dist_infer.cli.cp_auto import resolve_cp_auto
    from dist_infer.topology.discovery import discover

    monkeypatch.setattr(cp_auto, "discover", lambda env: None)  # started by hand
    args = SimpleNamespace(cp="auto", tp=1, pp=1, ep=1, nproc=4, log_level="INFO")
    argv = ["generate", "--cp", "auto", "--nproc", "4", "--prompt-ids", "@p"]
    assert resolve_cp_auto(args, argv, 9000) == ["generate", "--cp", "2", "--nproc", "2", "--prompt-ids", "@p"]
    assert (args.cp, args.nproc) == (2, 2), "4 ranks allowed, but 9000 tokens give only 2 of them 4096 each"
    args = SimpleNamespace(cp="auto", tp=2, pp=1, ep=1, nproc=None, log_level="INFO")
    assert resolve_cp_auto(args, ["bench", "--cp=auto", "--tp", "2"], 100) == ["bench", "--cp=1", "--tp", "2"]
    assert args.cp == 1
    # under a launcher (torchrun's variables) the ranks exist already: cp fills the job
    monkeypatch.setattr(cp_auto, "discover", lambda env: discover({"RANK": "0", "WORLD_SIZE": "4"}))
    args = SimpleNamespace(cp="auto", tp=2, pp=1, ep=1, nproc=None, log_level="INFO")
    resolve_cp_auto(args, ["generate", "--cp", "auto"], 100)
    assert args.cp == 2
    args = SimpleNamespace(cp="auto", tp=3, pp=1, ep=1, nproc=None, log_level="INFO")
    with pytest.raises(SystemExit, match="4 ranks do not divide by tp x pp x ep = 3"):
        resolve_cp_auto(args, ["generate", "--cp", "auto"], 100)


def test_cp_auto_starts_two_ranks_for_a_long_prompt_and_one_for_a_short_one(tmp_path, store):
    """`generate --cp auto` through the real CLI: 8192 tokens -> cp=2 (4096 per rank), 100 tokens
    -> one process; both continue exactly as the single process does."""
    model = store.model("llama-gqa", max_position_embeddings=8300)
    long_file = tmp_path / "long.txt"
    long_file.write_text(",".join(map(str, prompts_for([8192], seed=8)[0])))
    short = ",".join(map(str, prompts_for([100], seed=9)[0]))
    for prompt, want_cp in ((f"@{long_file}", 2), (short, 1)):
        ids = {}
        for flags in (["--cp", "auto", "--nproc", "2"], ["--nproc", "1"]):
            result = run(["dist-infer", "generate", "--model", str(model), "--prompt-ids", prompt,
                          "--max-new-tokens", "3", "--no-eos-stop", "--json", *flags], TIMEOUT_S)
            assert result.returncode == 0, f"{flags} exited {result.returncode}"
            out = json.loads([ln for ln in result.stdout.splitlines() if ln.strip()][-1])
            if "auto" in flags:
                assert (out["parallel"]["cp"], out["parallel"]["world_size"]) == (want_cp, want_cp), out["parallel"]
                assert f"--cp auto: cp={want_cp}" in result.stderr
            ids[flags[0]] = out["outputs"][0]["token_ids"]
        assert ids["--cp"] == ids["--nproc"]

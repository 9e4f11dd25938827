"""llama.cpp as a `bench --compare` peer: parsing what its benchmark programs print (samples recorded
from llama-bench and llama-batched-bench built from llama.cpp 0.5.0-dev, commit 0c1e570, trimmed to
the keys read), the command lines, the failures that must name their cure, the whole peer through a
stand-in binary, and once through the real llama-bench where it is on PATH."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from dist_infer.bench.flags import COMPARABLE, parse_compare
from dist_infer.bench.peers import run_peer
from dist_infer.bench.peers.llama_cpp import (
    BATCHED,
    BENCH,
    batched_argv,
    bench_argv,
    check,
    llama_repeats,
    parse_batched,
    parse_bench,
    parse_version,
    run_llama_cpp,
)

LLAMA_BENCH_JSON = """[
 {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
  "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf", "model_type": "llama 256M Q4_1", "n_threads": 2,
  "n_prompt": 8, "n_gen": 0, "n_depth": 0, "avg_ns": 31213800, "avg_ts": 256.297766, "stddev_ts": 0.66997,
  "samples_ns": [31271496, 31156105], "samples_ts": [255.824, 256.772]},
 {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "backends": "CPU",
  "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf", "model_type": "llama 256M Q4_1", "n_threads": 2,
  "n_prompt": 0, "n_gen": 4, "n_depth": 0, "avg_ns": 24896867, "avg_ts": 160.662785, "stddev_ts": 0.0,
  "samples_ns": [24896867], "samples_ts": [160.663]}
]
"""

BATCHED_JSONL = (
    '{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, '
    '"n_threads": 2, "n_threads_batch": 2, "pp": 8, "tg": 4, "pl": 2, "n_kv": 24, "t_pp": 0.921073, '
    '"speed_pp": 17.371044, "t_tg": 1.077284, "speed_tg": 7.426083, "t": 1.998357, "speed": 12.009866}\n'
    '{"n_kv_max": 512, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, '
    '"n_threads": 2, "n_threads_batch": 2, "pp": 8, "tg": 4, "pl": 2, "n_kv": 24, "t_pp": 1.156029, '
    '"speed_pp": 13.840484, "t_tg": 0.965592, "speed_tg": 8.285072, "t": 2.121621, "speed": 11.312104}\n'
    "\n"
)

VERSION = "version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0 for Linux x86_64\n"


def test_parse_llama_bench():
    got = parse_bench(LLAMA_BENCH_JSON, 8, 4)
    assert got["prefill_tok_s"] == 256.772 and got["prefill_tok_s_all"] == [255.824, 256.772]  # best repetition
    assert got["decode_tok_s"] == 160.663 and got["build_commit"] == "0c1e570"
    with pytest.raises(ValueError, match="pp16"):
        parse_bench(LLAMA_BENCH_JSON, 16, 4)


def test_parse_batched_bench():
    got = parse_batched(BATCHED_JSONL, 2, 8, 4)
    assert got["prefill_tok_s"] == 17.371044 and got["decode_tok_s"] == 8.285072
    assert got["decode_tok_s_all"] == [7.426083, 8.285072]
    with pytest.raises(ValueError, match="context -c"):  # what it prints when -c was too small: nothing
        parse_batched("\n", 2, 8, 4)


def test_parse_version():
    assert parse_version(VERSION) == "0.5.0-dev (build 1, commit 0c1e570); built with GNU 12.2.0 for Linux x86_64"
    assert parse_version("") is None


def test_argv():
    assert bench_argv("llama-bench", "m.gguf", 128, 32, 2, 3) == [
        "llama-bench",
        "-m",
        "m.gguf",
        "-p",
        "128",
        "-n",
        "32",
        "-t",
        "2",
        "-r",
        "3",
        "-o",
        "json",
    ]
    assert batched_argv("llama-batched-bench", "m.gguf", 4, 128, 32, 8, 2) == [
        "llama-batched-bench",
        "-m",
        "m.gguf",
        "-c",
        "640",
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        "128,128",
        "-ntg",
        "32",
        "-npl",
        "4",
        "-t",
        "8",
        "--output-format",
        "jsonl",
    ]
    assert (llama_repeats(1), llama_repeats(5)) == (3, 5)
    assert "llama.cpp" in COMPARABLE and parse_compare("hf, llama.cpp") == ["hf", "llama.cpp"]


def test_clear_failures(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    exe, why = check(str(gguf), 1, which=lambda name: None)
    assert exe is None and "llama-bench" in why and "make llama-cpp" in why
    exe, why = check(str(gguf), 4, which=lambda name: None)
    assert exe is None and BATCHED in why and "make llama-cpp" in why
    exe, why = check(str(tmp_path), 1, which=lambda name: "/bin/" + name)  # an HF checkpoint directory
    assert exe is None and "GGUF" in why and "convert_hf_to_gguf.py" in why
    monkeypatch.setenv("PATH", str(tmp_path))  # through the bench's entry point: a failed peer, no exception
    m = run_peer("llama.cpp", str(gguf), 1, 1, 8, 4, timeout_s=10)
    assert m["ok"] is False and "make llama-cpp" in m["error"] and m["prefill_tok_s"] is None


def _stand_in(tmp_path: Path, name: str, stdout: str, rc: int = 0) -> Path:
    """A script named like the binary: prints the recorded output (and the version to stderr)."""
    (tmp_path / "out.txt").write_text(stdout)
    script = tmp_path / name
    script.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then printf "{VERSION}" >&2; exit 0; fi\n'
        f"cat {tmp_path / 'out.txt'}\nexit {rc}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_whole_peer_through_stand_in(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    exe = _stand_in(tmp_path, BENCH, LLAMA_BENCH_JSON)
    m = run_llama_cpp(str(gguf), 1, 8, 4, threads=2, repeats=3, timeout_s=10, which=lambda name: str(exe))
    assert m["ok"] is True and m["error"] is None and "token_ids" not in m and "timing only" in m["note"]
    assert m["ttft_s"] == pytest.approx(8 / 256.772) and m["tpot_s"] == pytest.approx(1 / 160.663)
    assert m["versions"]["llama.cpp"].startswith("0.5.0-dev") and m["command"].endswith("-r 3 -o json")
    exe = _stand_in(tmp_path, BATCHED, BATCHED_JSONL)
    m = run_llama_cpp(str(gguf), 2, 8, 4, threads=2, repeats=2, timeout_s=10, which=lambda name: str(exe))
    assert (
        m["ok"] is True and m["ttft_s"] == pytest.approx(16 / 17.371044) and m["tpot_s"] == pytest.approx(2 / 8.285072)
    )
    exe = _stand_in(tmp_path, BATCHED, "error: unable to load model\n", rc=1)
    m = run_llama_cpp(str(gguf), 2, 8, 4, threads=2, timeout_s=10, which=lambda name: str(exe))
    assert m["ok"] is False and "exited with code 1" in m["error"] and "unable to load model" in m["stderr_tail"]


@pytest.mark.skipif(shutil.which(BENCH) is None, reason="llama-bench is not on PATH (make llama-cpp)")
def test_real_llama_bench_on_default_gguf():
    from dist_infer.models.builtin import resolve_model

    model = str(resolve_model("default"))
    m = run_llama_cpp(model, 1, 8, 4, threads=min(2, os.cpu_count() or 1), repeats=1, timeout_s=60)
    assert m["ok"] is True, json.dumps(m)
    assert m["command"].endswith("-p 8 -n 4 -t %d -r 1 -o json" % m["threads"])
    assert m["prefill_tok_s"] > 0 and m["decode_tok_s"] > 0 and m["peak_rss_mb"] > 10
    assert "commit" in m["versions"]["llama.cpp"]

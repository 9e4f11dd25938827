"""llama.cpp as a `bench --compare` peer: its own benchmark programs on the same GGUF file.

llama.cpp is C++, so this peer starts its binaries rather than a Python runner, found on PATH
(`make llama-cpp` puts them into .venv/bin):

- batch 1: ``llama-bench -m FILE -p P -n G -t T -r R -o json``; prefill tok/s from the pp test
  (n_prompt=P), decode tok/s from the tg test (n_gen=G). llama-bench's tg test decodes from an
  empty cache, where ours decodes after the P prompt tokens.
- batch B > 1: ``llama-batched-bench -m FILE -c (P+G)*B -b 2048 -ub 512 -npp P,...(R times) -ntg G
  -npl B -t T --output-format jsonl``: B sequences of P tokens prefilled in one batch (``speed_pp``),
  then G steps of B tokens (``speed_tg``). Listing P R times makes it run the workload R times.

``-t T`` is the total number of cores our own run used (ranks x threads per rank, at most this
host's usable cores), so both sides get the same cores. R is the bench's --repeat when above 1,
else 3; as for our engine and the other peers, the best repetition is reported (the one least
disturbed by other work on a shared machine), and every repetition is kept in ``*_all``. Its
worker threads spin at each op's barrier, so on cores busy with other work it slows down far more
than the load alone explains: read ``loadavg_1m`` (added by `run_peer`) beside its numbers.

Derived like the other peers' metrics: ``ttft_s = B*P / prefill_tok_s``, ``tpot_s = B /
decode_tok_s``. ``peak_rss_mb`` is the child's high-water mark (VmHWM), read from /proc while it
runs: `getrusage(RUSAGE_CHILDREN)` would be the largest of every child so far, our ranks included.
Both programs feed random token ids and never sample, so there is no ``token_ids``: the numbers are
timing only and no output comparison is made for this peer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from dist_infer.bench.peers.metrics import empty_metrics, failed
from dist_infer.models.gguf.magic import is_gguf
from dist_infer.topology.processes import stop_process_groups

PEER = "llama.cpp"
BENCH = "llama-bench"
BATCHED = "llama-batched-bench"
INSTALL_HINT = "run `make llama-cpp` (it builds llama.cpp's llama-bench and llama-batched-bench into .venv/bin)"
NOTE = "timing only: llama.cpp's benchmarks decode random token ids, so there is no output to compare"


def llama_repeats(repeats: int) -> int:
    """The repetitions the bench asks of llama.cpp for its --repeat."""
    return repeats if repeats > 1 else 3


def bench_argv(exe: str, model: str, prompt_len: int, gen_len: int, threads: int, repeats: int) -> list[str]:
    """Batch 1: one pp test of P tokens and one tg test of G tokens, R repetitions each."""
    return [
        exe,
        "-m",
        str(model),
        "-p",
        str(prompt_len),
        "-n",
        str(gen_len),
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-o",
        "json",
    ]


def batched_argv(
    exe: str, model: str, batch: int, prompt_len: int, gen_len: int, threads: int, repeats: int
) -> list[str]:
    """Batch B: B x P prefill then G decode steps of B tokens, the whole workload R times."""
    return [
        exe,
        "-m",
        str(model),
        "-c",
        str((prompt_len + gen_len) * batch),
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        ",".join([str(prompt_len)] * repeats),
        "-ntg",
        str(gen_len),
        "-npl",
        str(batch),
        "-t",
        str(threads),
        "--output-format",
        "jsonl",
    ]


def parse_bench(text: str, prompt_len: int, gen_len: int) -> dict:
    """llama-bench's -o json (a list of tests) -> best and all per-repetition prefill / decode tok/s."""
    tests = json.loads(text)
    pp = [t for t in tests if t.get("n_prompt") == prompt_len and t.get("n_gen") == 0]
    tg = [t for t in tests if t.get("n_gen") == gen_len and t.get("n_prompt") == 0]
    if not pp or not tg:
        raise ValueError(f"llama-bench printed no pp{prompt_len} and tg{gen_len} tests")
    pre = [float(x) for x in pp[0].get("samples_ts") or [pp[0]["avg_ts"]]]
    dec = [float(x) for x in tg[0].get("samples_ts") or [tg[0]["avg_ts"]]]
    return {
        "prefill_tok_s": max(pre),
        "decode_tok_s": max(dec),
        "prefill_tok_s_all": pre,
        "decode_tok_s_all": dec,
        "build_commit": pp[0].get("build_commit"),
        "model_type": pp[0].get("model_type"),
    }


def parse_batched(text: str, batch: int, prompt_len: int, gen_len: int) -> dict:
    """llama-batched-bench's jsonl (one line per run; other lines skipped) -> best and all tok/s."""
    runs = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if (row.get("pp"), row.get("tg"), row.get("pl")) == (prompt_len, gen_len, batch):
            runs.append(row)
    if not runs:
        raise ValueError(
            f"llama-batched-bench printed no run of pp={prompt_len} tg={gen_len} pl={batch} "
            "(it skips a run silently when the context -c is too small)"
        )
    pre = [float(r["speed_pp"]) for r in runs]
    dec = [float(r["speed_tg"]) for r in runs]
    return {"prefill_tok_s": max(pre), "decode_tok_s": max(dec), "prefill_tok_s_all": pre, "decode_tok_s_all": dec}


def parse_version(text: str) -> Optional[str]:
    """`--version` prints 'version: 0.5.0-dev (build 1, commit abc)' and 'built with ...' (to stderr)."""
    lines = [ln.strip() for ln in text.splitlines()]
    found = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("version:")]
    built = [ln for ln in lines if ln.startswith("built with")]
    return "; ".join(found[:1] + built[:1]) or None


def llama_cpp_version(exe: str) -> Optional[str]:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(out.stdout + "\n" + out.stderr)


def check(model_path: str, batch: int, which=shutil.which) -> tuple[Optional[str], Optional[str]]:
    """-> (the binary for this batch, None) or (None, why this peer cannot run)."""
    name = BENCH if batch == 1 else BATCHED
    exe = which(name)
    if exe is None:
        return None, f"llama.cpp's {name} is not on PATH; {INSTALL_HINT}"
    path = Path(model_path)
    if path.is_dir() or not is_gguf(path):
        return None, (
            f"llama.cpp needs a GGUF file and --model is {'a directory' if path.is_dir() else 'not GGUF'} "
            f"({model_path}); convert a HF checkpoint with llama.cpp's convert_hf_to_gguf.py and bench "
            "the .gguf"
        )
    return exe, None


def _hwm_mb(pid: int) -> Optional[float]:
    """The process's peak resident set so far (VmHWM), MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def run_child(argv: list[str], timeout_s: float, poll_s: float = 0.02) -> dict:
    """Run argv in its own session; -> rc, stdout, stderr, timed_out, wall_s and its peak RSS (MiB)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out_f, stderr=err_f, env=env, start_new_session=True)
        peak, timed_out = 0.0, False
        while proc.poll() is None:
            peak = max(peak, _hwm_mb(proc.pid) or 0.0)
            if time.perf_counter() - t0 > timeout_s:
                timed_out = True
                stop_process_groups([proc], grace=5.0)
                break
            time.sleep(poll_s)
        wall = time.perf_counter() - t0
        out_f.seek(0)
        err_f.seek(0)
        return {
            "rc": proc.returncode,
            "stdout": out_f.read(),
            "stderr": err_f.read(),
            "timed_out": timed_out,
            "wall_s": wall,
            "peak_rss_mb": peak or None,
        }


def run_llama_cpp(
    model_path: str,
    batch: int,
    prompt_len: int,
    gen_len: int,
    threads: Optional[int] = None,
    repeats: int = 3,
    timeout_s: float = 1800.0,
    which=shutil.which,
) -> dict:
    """llama.cpp's benchmark for this workload, `repeats` times -> the peers' metrics dict (ok False and
    why on failure)."""
    from dist_infer.topology.cores import usable_cores

    threads = threads or usable_cores()
    exe, why = check(model_path, batch, which)
    if exe is None:  # (and `why` says why)
        return failed(
            PEER,
            why or "llama.cpp cannot run",
            threads=threads,
            batch=batch,
            prompt_len=prompt_len,
            gen_len=gen_len,
            note=NOTE,
        )
    argv = (
        bench_argv(exe, model_path, prompt_len, gen_len, threads, repeats)
        if batch == 1
        else batched_argv(exe, model_path, batch, prompt_len, gen_len, threads, repeats)
    )
    child = run_child(argv, timeout_s)
    out = empty_metrics(PEER)
    out.update(
        threads=threads,
        batch=batch,
        prompt_len=prompt_len,
        gen_len=gen_len,
        world_size=1,
        repeats=repeats,
        command=" ".join(argv),
        wall_s=child["wall_s"],
        peak_rss_mb=child["peak_rss_mb"],
        note=NOTE,
        versions={"llama.cpp": llama_cpp_version(exe) or "?"},
    )
    try:
        parsed = (
            parse_bench(child["stdout"], prompt_len, gen_len)
            if batch == 1
            else parse_batched(child["stdout"], batch, prompt_len, gen_len)
        )
    except (ValueError, KeyError, TypeError) as exc:
        parsed, why = None, str(exc)
    if child["timed_out"] or child["rc"] != 0 or parsed is None:
        status = f"timed out after {timeout_s:.0f}s" if child["timed_out"] else f"exited with code {child['rc']}"
        out["error"] = f"{Path(exe).name} {status}" + (f": {why}" if parsed is None else "")
        out["stderr_tail"] = (child["stderr"].strip() or child["stdout"].strip())[-4000:]
        return out
    tokens = batch * prompt_len
    out.update(
        parsed,
        ok=True,
        error=None,
        ttft_s=tokens / parsed["prefill_tok_s"],
        tpot_s=batch / parsed["decode_tok_s"],
        ttft_s_all=[tokens / r for r in parsed["prefill_tok_s_all"]],
        tpot_s_all=[batch / r for r in parsed["decode_tok_s_all"]],
    )
    return out

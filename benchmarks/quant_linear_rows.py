"""quant_linear at batch 1 on the default model's shapes, one build of cpu_kernels.c against another.

Compiles dist_infer/kernels/cpu_kernels.c as it is at each git revision given (`WORKTREE`: the file
on disk) and times the raw C call (pointers prepared once, no Python in the loop) over the 30
layers' int4 weights of SmolLM2-135M (QKV 960 x 576, o 576 x 576, gate/up 3072 x 576, down
576 x 1536; groups of 32 with zeros, as its Q4_1 blocks), and the tied int8 LM head (49152 x 576),
alternating the builds over rounds. docs/benchmarks.md, "Weights that stay quantized".

    python benchmarks/quant_linear_rows.py --revs HEAD~1 WORKTREE --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "dist_infer" / "kernels"
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def build(rev: str, out_dir: Path) -> ctypes.CDLL:
    """The library as `rev` has it: its kernel sources, under their own names in a folder of their
    own (decode_stack.c includes cpu_kernels.h beside it; older revisions have only cpu_kernels.c)."""
    src = out_dir / rev.replace("/", "_")
    src.mkdir()
    for name in ("cpu_kernels.c", "cpu_kernels.h", "decode_stack.c"):
        if rev == "WORKTREE":
            text = (KERNELS / name).read_bytes() if (KERNELS / name).exists() else None
        else:
            shown = subprocess.run(["git", "show", f"{rev}:dist_infer/kernels/{name}"], cwd=ROOT, capture_output=True)
            text = shown.stdout if shown.returncode == 0 else None
        if text is not None:
            (src / name).write_bytes(text)
    lib = src / "kernels.so"
    subprocess.run(
        [
            "cc",
            "-O3",
            "-march=native",
            "-fPIC",
            "-shared",
            "-fopenmp",
            *map(str, sorted(src.glob("*.c"))),
            "-o",
            str(lib),
            "-lm",
        ],
        check=True,
    )
    so = ctypes.CDLL(str(lib))
    so.quant_linear.restype = ctypes.c_int
    so.quant_linear.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 4 + [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    return so


def weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(30):
        for n, k in LAYER_SHAPES:
            layers.append(
                (
                    torch.randn(1, k, generator=g),
                    torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                    torch.rand(n, k // 32, generator=g) * 0.01,
                    -torch.rand(n, k // 32, generator=g) * 0.08,
                    torch.empty(1, n),
                    4,
                )
            )
    head = [
        (
            torch.randn(1, 576, generator=g),
            torch.randint(-128, 128, (49152, 576), dtype=torch.int8, generator=g),
            torch.rand(49152, 18, generator=g) * 0.01,
            None,
            torch.empty(1, 49152),
            8,
        )
    ]
    return {"30 layers, int4": layers, "LM head, int8": head}


def timed(lib: ctypes.CDLL, calls, threads: int, repeat: int) -> float:
    args = [
        (
            x.data_ptr(),
            q.data_ptr(),
            s.data_ptr(),
            None if z is None else z.data_ptr(),
            y.data_ptr(),
            1,
            q.shape[0],
            x.shape[1],
            32,
            bits,
            q.shape[0],
            threads,
        )
        for x, q, s, z, y, bits in calls
    ]
    fn = lib.quant_linear
    for a in args:
        fn(*a)
    start = time.perf_counter()
    for _ in range(repeat):
        for a in args:
            fn(*a)
    return (time.perf_counter() - start) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revs", nargs="+", default=["HEAD", "WORKTREE"], help="git revisions, or WORKTREE")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--repeat", type=int, default=20, help="passes over the weights per timing")
    ap.add_argument("--threads", type=int, default=2, help="OpenMP threads of each call")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {rev: build(rev, Path(tmp)) for rev in args.revs}
        sets = weights()
        for r in range(args.rounds):
            for name, calls in sets.items():
                cells = [
                    f"{rev} {timed(libs[rev], calls, args.threads, args.repeat) * 1e3:.2f} ms" for rev in args.revs
                ]
                print(f"round {r + 1}, {name}: " + ", ".join(cells))


if __name__ == "__main__":
    main()

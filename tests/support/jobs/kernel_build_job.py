"""One of several processes that build the native kernels into one cache directory at once, as
the ranks of a node do (tests/integration/test_kernel_build_processes.py).

It touches READY, waits for GO (so that every process asks for the build within a few ms of the
others), builds with require (an error is an exit), checks a product, and prints the library's path.

usage: python kernel_build_job.py CACHE_DIR COMPILER READY GO
"""

import sys
import time
from pathlib import Path

import torch
from loguru import logger

from dist_infer.kernels.build import KernelBuild, load_native_kernels

logger.enable("dist_infer")  # the waiting line is part of what the test reads
cache, compiler, ready, go = sys.argv[1:5]
Path(ready).touch()
deadline = time.monotonic() + 120
while not Path(go).exists():
    if time.monotonic() > deadline:
        sys.exit("no GO within 120 s")
    time.sleep(0.01)
kernels = load_native_kernels(KernelBuild("require", (compiler,), (Path(cache),)))
x, w = torch.randn(2, 16), torch.randn(8, 16)
torch.testing.assert_close(kernels.skinny_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
print("LIBRARY", kernels.library_path, flush=True)

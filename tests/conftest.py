"""The suite's set-up: the tiny model by default, and `slow` by folder.

tests/unit/<package>/ holds the tests that run in this one process (threads at most), by the
package of the code they test; tests/integration/ the tests that start processes (ranks under our
launcher, torchrun or mpirun, `dist-infer` commands, servers, peers, network namespaces). Every
test under tests/integration/ is marked `slow`, so `-m "not slow"` selects exactly tests/unit/.
tests/gpu/ (`gpu` and `slow`) holds the CUDA paths on a real device: `make gpu-check`.
Shared helpers live in the package tests.support (`from tests.support.processes import run`);
the scripts the tests run as processes in tests/support/jobs/.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
INTEGRATION = TESTS / "integration"
GPU = TESTS / "gpu"  # the CUDA paths on a real device (make gpu-check); skipped where torch sees none

# Triton kernels (dist_infer/kernels/gpu) run in Triton's interpreter on CPU tensors where no GPU is
# seen; it must be set before their module is imported (each `triton.jit` decides then).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A command without --model runs the `tiny` random model in the tests (and every process they start):
# it loads in a blink. Tests of the trained default model pass `--model default` explicitly.
os.environ["DIST_INFER_MODEL"] = "tiny"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.slow)
        elif GPU in item.path.parents:  # they start processes too, where they run at all
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.gpu)

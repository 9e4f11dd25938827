"""tests/gpu: cuBLAS in its deterministic workspace mode from the start (before any test starts it), so
a test can ask torch for deterministic algorithms and hold graphs to the eager steps bit for bit."""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

"""The embedded default model (`tiny`, models/tiny_model.py) is the same bytes in every process:
written twice here and once by a separate process (other hash seeds, Python's and Rust's)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_infer.models.tiny_model import FILES, NAME, ensure_tiny_model
from tests.support.paths import REPO


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def test_default_model_deterministic(tmp_path, tiny_model):
    other = ensure_tiny_model(tmp_path / "fresh")
    assert other == tmp_path / "fresh" / NAME
    assert _digests(other) == _digests(tiny_model)
    assert sorted(_digests(other)) == sorted(FILES)
    # A separate process has different hash seeds (Python's and Rust's): same bytes still.
    env = dict(os.environ, PYTHONHASHSEED="12345", DIST_INFER_CACHE=str(tmp_path / "proc"))
    subprocess.run(
        [sys.executable, "-c", "from dist_infer.models.tiny_model import ensure_tiny_model as e; e()"],
        cwd=REPO,
        env=env,
        check=True,
        timeout=120,
    )
    assert _digests(tmp_path / "proc" / NAME) == _digests(tiny_model)

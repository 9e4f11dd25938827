"""Fixtures of the structured-output tests, for a conftest to import: a small random Llama with
the tiny model's byte-level BPE tokenizer (what llguidance reads a vocabulary from), and that
tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory) -> Path:
    """1000 tokens ("</s>" = 1, EOS) over a 1024-wide LM head (tests/support/structured_checkpoints.py)."""
    from tests.support.structured_checkpoints import write_structured_checkpoint

    return write_structured_checkpoint(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="session")
def text_tokenizer(small_checkpoint):
    from dist_infer.engine.tokenizer import TextTokenizer

    return TextTokenizer(small_checkpoint)

"""Fixtures of the structured-output tests: the tiny model's byte-level BPE tokenizer (what
llguidance reads a vocabulary from), and a small random Llama checkpoint with it."""

from __future__ import annotations

from pathlib import Path

import pytest

SMALL_ARCH = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory) -> Path:
    """The tiny model's tokenizer (1000 tokens, EOS "</s>" = 1) over a 1024-wide LM head, 2 small layers."""
    from dist_infer.models.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("structured"), **SMALL_ARCH)


@pytest.fixture(scope="session")
def text_tokenizer(small_checkpoint):
    from dist_infer.engine.tokenizer import TextTokenizer

    return TextTokenizer(small_checkpoint)

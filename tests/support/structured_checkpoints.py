"""A small random model with a real tokenizer, for structured outputs (which need every token's bytes).

The tiny model's byte-level BPE (1000 tokens, "<s>" = 0, "</s>" = 1) over a seeded checkpoint of
checkpoints.py (llama-gqa, or another of its architectures: mixtral for expert parallel), 1024 ids wide: the LM head is wider than the tokenizer, as padded
vocabularies are. Its weights have the std 0.1 of checkpoints.py, so greedy choices are not near
ties and a layout that computes the same logits to rounding picks the same tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from tests.support.checkpoints import write_hf_checkpoint

VOCAB = 1024
EOS = 1


def write_structured_checkpoint(
    tmpdir: Union[str, os.PathLike], arch: str = "llama-gqa", seed: int = 0, max_positions: int = 512
) -> Path:
    """Write the checkpoint of `arch` (checkpoints.ARCHS: config, weights, tokenizer.json) into
    tmpdir/structured-<arch>, `max_positions` long; returns its path."""
    from dist_infer.models.tiny_model import build_tokenizer

    path = write_hf_checkpoint(
        tmpdir,
        arch,
        seed=seed,
        subdir=f"structured-{arch}",
        vocab_size=VOCAB,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=EOS,
    )
    build_tokenizer().save(str(path / "tokenizer.json"))
    return path

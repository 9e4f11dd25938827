"""bench-serve's random prompts (bench/serve/prompts.py)."""

from __future__ import annotations

import numpy as np

from dist_infer.bench.serve.prompts import sentence_text_prompt


def test_sentence_text_prompt_is_about_n_tokens_of_sentences():
    text = sentence_text_prompt(64, np.random.default_rng(0))
    assert len(text.split()) == 56 and text.count(".") == 8 and text.endswith(".")
    assert sentence_text_prompt(1, np.random.default_rng(0)).count(" ") == 0

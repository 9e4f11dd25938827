"""Random prompts for bench-serve: common words (about a token each), sentences of them that shared
prefixes are made of, or token ids, drawn from the run's seeded generator.

Apart from the datasets (`datasets`) because multi-turn chats (`conversations`) draw their
prompts the same way.
"""

from __future__ import annotations

import argparse
from typing import Union

import numpy as np

FIRST_RANDOM_ID = 10  # random prompt ids start here so they avoid the usual special tokens (bos, eos, pad)
SENTENCE_WORDS = 7  # words per sentence of a shared text prefix: 7 words and a period, about 8 tokens

# Short common words: most tokenizers map " word" to one token, so N words are about N tokens.
PROMPT_WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "over",
    "new",
    "sound",
    "take",
    "only",
    "little",
    "work",
    "know",
    "place",
    "year",
    "live",
    "me",
    "back",
    "give",
    "most",
    "very",
    "after",
    "thing",
    "our",
    "just",
    "name",
    "good",
    "sentence",
    "man",
    "think",
    "say",
    "great",
    "where",
    "help",
    "through",
    "much",
)


def random_text_prompt(n_tokens: int, rng: np.random.Generator) -> str:
    """n random common words, about n tokens for most tokenizers (see PROMPT_WORDS)."""
    return " ".join(PROMPT_WORDS[i] for i in rng.integers(0, len(PROMPT_WORDS), size=n_tokens))


def random_id_prompt(n_tokens: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    """n random ids in [FIRST_RANDOM_ID, vocab_size): exact lengths without a tokenizer."""
    return [int(i) for i in rng.integers(FIRST_RANDOM_ID, vocab_size, size=n_tokens)]


def sentence_text_prompt(n_tokens: int, rng: np.random.Generator) -> str:
    """About n tokens of random common words in sentences of SENTENCE_WORDS words, ending with a period.

    Shared text prefixes are made of these: a prefix that ends at a period, followed by a space and
    the next word, tokenizes the same way in front of any suffix (BPE and SentencePiece tokenizers
    split before the space), so the server's tokenizer sees the same leading tokens in every
    request of a group. The count is approximate: a word is one token for most tokenizers, a
    period one more.
    """
    n_words = max(1, n_tokens - n_tokens // (SENTENCE_WORDS + 1))
    words = [PROMPT_WORDS[i] for i in rng.integers(0, len(PROMPT_WORDS), size=n_words)]
    return " ".join(" ".join(words[i : i + SENTENCE_WORDS]) + "." for i in range(0, n_words, SENTENCE_WORDS))


def shared_prefixes(args: argparse.Namespace, rng: np.random.Generator) -> list[Union[str, list[int]]]:
    """--num-prefixes distinct prefixes of --prefix-len tokens: random ids with --prompt-ids, else sentences."""
    if args.prompt_ids:
        return [random_id_prompt(args.prefix_len, args.vocab_size, rng) for _ in range(args.num_prefixes)]
    return [sentence_text_prompt(args.prefix_len, rng) for _ in range(args.num_prefixes)]

"""Prompts whose answers repeat their input, and prompts whose answers do not: the streams
speculative decoding is measured on (`--dataset copy`, `--dataset write`).

Copy tasks are what prompt lookup serves in practice: edit code and give it back, rewrite a list
as a table, copy the matching lines of a log, give back a paragraph with its typos fixed, quote a
paragraph. Their
material is made from the run's seeded generator (names, cities, functions, log lines), so the
same --seed sends the same requests and a new seed fresh ones (no server's prompt cache helps).
Write tasks ask for new text on a topic: nothing in the prompt to copy, the stream where
speculation must cost (almost) nothing.
"""

from __future__ import annotations

import numpy as np

NAMES = ("Ada", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena")
CITIES = ("Lisbon", "Oslo", "Cairo", "Lima", "Osaka", "Quebec", "Perth", "Zurich", "Nairobi", "Hanoi", "Porto")
ITEMS = ("lamp", "kettle", "bicycle", "ladder", "blanket", "compass", "teapot", "hammer", "violin", "atlas")
LEVELS = ("INFO", "INFO", "INFO", "WARN", "ERROR")
EVENTS = (
    "connection accepted from",
    "request served for",
    "cache miss on key",
    "retrying upload to",
    "disk nearly full on",
    "timeout waiting for",
)
TYPOS = {"the": "teh", "receive": "recieve", "separate": "seperate", "which": "wich", "their": "thier"}
SENTENCES = (
    "The committee will receive the report before their meeting on Monday.",
    "Please keep the two folders separate, which makes the review easier.",
    "The engineers checked the bridge and found the cables in good order.",
    "Their garden grows tomatoes, beans and the tallest sunflowers in town.",
    "Which train leaves first depends on the weather and the track work.",
    "The library will receive new books in the spring, which pleases their readers.",
)
TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "why the sky looks blue at noon and red at sunset",
    "how bees decide where to build a new hive",
    "a city where it rains only at night",
    "the history of the printing press in a few paragraphs",
    "what makes a good friend",
)


def _pick(rng: np.random.Generator, options) -> str:
    return options[int(rng.integers(0, len(options)))]


def _function(rng: np.random.Generator, name: str, var: str) -> str:
    """A small Python function over a list, using `var` several times."""
    item = _pick(rng, ITEMS)
    limit = int(rng.integers(2, 50))
    return (
        f"def {name}({var}s, limit={limit}):\n"
        f'    """Count the items of kind {item} in {var}s, up to limit."""\n'
        f"    total = 0\n"
        f"    for {var} in {var}s:\n"
        f'        if {var}.kind == "{item}" and {var}.count > 0:\n'
        f"            total += {var}.count\n"
        f"        if total >= limit:\n"
        f"            break\n"
        f"    return min(total, limit)\n"
    )


def edit_code(rng: np.random.Generator) -> str:
    old, new = _pick(rng, ("entry", "record", "row")), _pick(rng, ("item", "element", "thing"))
    code = "\n".join(_function(rng, f"count_{_pick(rng, ITEMS)}s_{i}", old) for i in range(2))
    return f"Rename the variable `{old}` to `{new}` in this code and give back the whole code.\n\n```python\n{code}```"


def rewrite_list(rng: np.random.Generator) -> str:
    rows = [
        f"- {_pick(rng, NAMES)} from {_pick(rng, CITIES)}, age {int(rng.integers(18, 90))}, owns a {_pick(rng, ITEMS)}"
        for _ in range(int(rng.integers(6, 10)))
    ]
    return "Rewrite this list as a Markdown table with columns Name, City, Age, Item.\n\n" + "\n".join(rows)


def extract_lines(rng: np.random.Generator) -> str:
    lines = [
        f"2026-11-{int(rng.integers(1, 29)):02d} {int(rng.integers(0, 24)):02d}:{int(rng.integers(0, 60)):02d} "
        f"{_pick(rng, LEVELS)} {_pick(rng, EVENTS)} {_pick(rng, CITIES).lower()}-{int(rng.integers(1, 9))}"
        for _ in range(int(rng.integers(12, 18)))
    ]
    return "Copy every line of this log that is not INFO, unchanged, in order.\n\n" + "\n".join(lines)


def fix_typos(rng: np.random.Generator) -> str:
    chosen = [SENTENCES[int(i)] for i in rng.permutation(len(SENTENCES))[:4]]
    text = " ".join(chosen)
    for right, wrong in TYPOS.items():
        text = text.replace(f" {right} ", f" {wrong} ")
    return f"Fix the spelling mistakes in this paragraph and give back the whole paragraph.\n\n{text}"


def quote_paragraph(rng: np.random.Generator) -> str:
    chosen = [SENTENCES[int(i)] for i in rng.permutation(len(SENTENCES))[:5]]
    return "Repeat this paragraph word for word, then stop.\n\n" + " ".join(chosen)


COPY_TASKS = (edit_code, rewrite_list, extract_lines, fix_typos, quote_paragraph)


def copy_prompt(rng: np.random.Generator) -> str:
    """One copy-heavy task, its kind and material drawn from `rng`."""
    return COPY_TASKS[int(rng.integers(0, len(COPY_TASKS)))](rng)


def write_prompt(rng: np.random.Generator) -> str:
    """A request for new text: nothing in it to copy."""
    return f"Write about {_pick(rng, TOPICS)}. Use your own words and do not repeat yourself."

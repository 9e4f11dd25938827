"""The copy-heavy tasks carry their material in the prompt (what an answer would repeat), each kind
comes up, and the write tasks have nothing of the sort."""

from __future__ import annotations

import numpy as np

from dist_infer.bench.serve.copy_tasks import COPY_TASKS, copy_prompt, write_prompt


def test_each_copy_task_carries_the_text_its_answer_repeats():
    rng = np.random.default_rng(0)
    for task in COPY_TASKS:
        prompt = task(rng)
        instruction, _, material = prompt.partition("\n\n")
        assert instruction and len(material.split()) >= 20, (task.__name__, prompt)
    code = COPY_TASKS[0](rng)
    old = code.split("`")[1]
    assert code.count(old) >= 6, "the variable to rename occurs all over the code"


def test_every_kind_comes_up_and_write_prompts_have_nothing_to_copy():
    rng = np.random.default_rng(1)
    starts = {copy_prompt(rng).split()[0] for _ in range(200)}
    assert starts == {"Rename", "Rewrite", "Copy", "Fix", "Repeat"}
    writes = [write_prompt(rng) for _ in range(20)]
    assert all(p.startswith("Write about ") and "\n" not in p and len(p.split()) < 30 for p in writes)

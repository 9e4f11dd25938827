"""Multi-turn conversations, the user's side: ShareGPT turns paired users with replies, and the
flags that cannot work exit 2 naming why."""

from __future__ import annotations

import numpy as np
import pytest

from dist_infer.bench.serve.command import main
from dist_infer.bench.serve.conversations import build_conversations, sharegpt_turns
from dist_infer.bench.serve.flags import InputError
from tests.support.bench_serve_inputs import bench_serve_args, write_multiturn_sharegpt


def test_sharegpt_turns_pairs_users_with_replies():
    system, pairs = sharegpt_turns(
        [
            {"from": "gpt", "value": "hi"},
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "a"},
            {"from": "human", "value": "b"},
            {"from": "gpt", "value": "c"},
            {"from": "user", "value": "d"},
            {"from": "assistant", "value": "e"},
            {"from": "human", "value": "f"},
        ]
    )
    assert system == "be nice" and pairs == [("a\nb", "c"), ("d", "e")]
    assert sharegpt_turns(
        [
            {"from": "human", "value": "x"},
            {"from": "gpt", "value": " "},
            {"from": "human", "value": "y"},
            {"from": "gpt", "value": "z"},
        ]
    ) == (None, [])


def test_multiturn_flags_that_cannot_work_exit_2(tmp_path, capsys):
    assert main(["--url", "http://127.0.0.1:9", "--multiturn"]) == 2
    assert "--dataset multiturn" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", "--dataset", "multiturn", "--endpoint", "chat", "--prompt-ids"]) == 2
    assert "--prompt-ids needs --endpoint completions" in capsys.readouterr().err
    share = write_multiturn_sharegpt(tmp_path)
    with pytest.raises(InputError, match="needs --tokenizer"):
        build_conversations(
            bench_serve_args("--dataset", share, "--multiturn", "--prompt-ids"), np.random.default_rng(0)
        )
    conversations, arrivals = build_conversations(
        bench_serve_args("--dataset", share, "--multiturn", "--turns", "9", "--request-rate", "2"),
        np.random.default_rng(0),
    )
    assert sorted(len(c.turns) for c in conversations) == [2, 3, 4, 5] and arrivals.startswith("Poisson at 2 req/s")
    assert [c.index for c in conversations] == [0, 1, 2, 3] and conversations[0].arrival_s == 0.0

"""bench-serve's inputs and outputs in the tests: its flags parsed alone, the JSON summary its
--json run prints last, and a multi-turn ShareGPT file."""

from __future__ import annotations

import argparse
import json

from dist_infer.bench.serve.flags import add_bench_serve_flags


def bench_serve_args(*argv: str) -> argparse.Namespace:
    """`argv` parsed by bench-serve's flags alone."""
    parser = argparse.ArgumentParser()
    add_bench_serve_flags(parser)
    return parser.parse_args(list(argv))


def last_json(stdout: str) -> dict:
    """The summary a --json run prints as its last line."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


def write_multiturn_sharegpt(tmp_path) -> str:
    """Four conversations of 2..5 answered turns (every other one with a system prompt) and one
    without a user turn, as a ShareGPT file under tmp_path; its path."""
    conversations = []
    for i in range(4):
        turns = [{"from": "system", "value": "You are terse."}] if i % 2 else []
        for k in range(2 + i):  # 2..5 answered turns
            turns += [
                {"from": "human", "value": f"question {k} of chat {i}"},
                {"from": "gpt", "value": "word " * (k + 2)},
            ]
        conversations.append({"id": str(i), "conversations": turns})
    conversations.append({"id": "lonely", "conversations": [{"from": "gpt", "value": "hello?"}]})
    path = tmp_path / "share.json"
    path.write_text(json.dumps(conversations))
    return str(path)
